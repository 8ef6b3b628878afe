//! The store's side of owned GPUs and reservations (migration 0018), a trait of its own
//! ([`super::Store::gpu_policy`]).
//!
//! The rules are in [`crate::domain::policy::reservations`]; this only keeps what an admin set
//! and which reservation a session or a job chain uses. A request's reservation is written
//! before the request itself, under the id the request will have (for a job, its chain's first
//! job, so every restart keeps it), so no scheduling round can see the request without it.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use ongrid_core::{GpuUuid, JobId, NodeName, SessionId};

use super::StoreResult;
use crate::domain::policy::reservations::{ReservationName, ReservationRecord};
use crate::domain::policy::GroupName;

/// The owners an admin set: whole nodes, and single GPUs (which win over their node's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owners {
    pub nodes: BTreeMap<NodeName, GroupName>,
    pub gpus: BTreeMap<GpuUuid, GroupName>,
}

/// What admins set of the site's GPUs: their owners and the reservations, ended ones too, by
/// start time ([`GpuPolicyStore::owners_and_reservations`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnersAndReservations {
    pub owners: Owners,
    pub reservations: Vec<ReservationRecord>,
}

/// Which reservation each session and each job chain (by its first job) uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestReservations {
    pub sessions: BTreeMap<SessionId, ReservationName>,
    pub chains: BTreeMap<JobId, ReservationName>,
}

pub trait GpuPolicyStore: Send + Sync {
    /// Sets (`Some`) or clears (`None`) a registered GPU's owner; `false`: no such GPU.
    fn set_gpu_owner<'a>(
        &'a self,
        gpu: &'a GpuUuid,
        owner: Option<&'a GroupName>,
    ) -> BoxFuture<'a, StoreResult<bool>>;

    /// Sets or clears a registered node's owner; `false`: no such node.
    fn set_node_owner<'a>(
        &'a self,
        node: &'a NodeName,
        owner: Option<&'a GroupName>,
    ) -> BoxFuture<'a, StoreResult<bool>>;

    /// The owners and every reservation, which every round and many views read: kept by the
    /// store and read again only when the inventory's version moved (a change of a node, a GPU,
    /// an owner or a reservation, through any store on the database).
    fn owners_and_reservations(&self) -> BoxFuture<'_, StoreResult<OwnersAndReservations>>;

    /// Stores a new reservation; `false` when its name is taken.
    fn add_reservation<'a>(
        &'a self,
        reservation: &'a ReservationRecord,
    ) -> BoxFuture<'a, StoreResult<bool>>;

    /// Removes a reservation; the removed one, or `None` when there was none of that name.
    /// Requests that named it wait like any other from then on.
    fn remove_reservation<'a>(
        &'a self,
        name: &'a ReservationName,
    ) -> BoxFuture<'a, StoreResult<Option<ReservationRecord>>>;

    /// Records that the session `id` (not stored yet) uses `reservation`.
    fn set_session_reservation<'a>(
        &'a self,
        id: SessionId,
        reservation: &'a ReservationName,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// Records that the job chain whose first job is `initial` (not stored yet) uses
    /// `reservation`.
    fn set_chain_reservation<'a>(
        &'a self,
        initial: JobId,
        reservation: &'a ReservationName,
    ) -> BoxFuture<'a, StoreResult<()>>;

    /// The reservations the sessions that have not ended and the stored job chains use.
    fn request_reservations(&self) -> BoxFuture<'_, StoreResult<RequestReservations>>;
}
