//! Owned GPUs and reservations on the wire (site policy): what `devctl admin gpu owner`,
//! `admin node owner` and `admin reservation add|ls|rm` send and get back.
//!
//! Routes: `PUT|DELETE /v1/gpus/{uuid}/owner`, `PUT|DELETE /v1/nodes/{name}/owner` (body
//! [`SetOwner`], answer [`OwnerView`]), `GET /v1/owners` (`Vec<OwnerView>`),
//! `GET|POST /v1/reservations` ([`NewReservation`], answer [`ReservationView`]),
//! `GET|DELETE /v1/reservations/{name}`. A session or job uses a reservation with
//! `?reservation=NAME` on `POST /v1/sessions` and `POST /v1/jobs`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{GpuUuid, NodeName};

/// Gives a GPU or node an owner group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetOwner {
    pub group: String,
}

/// An owned node or GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerView {
    pub node: NodeName,
    /// `None`: the whole node (every GPU of it without an owner of its own).
    pub gpu: Option<GpuUuid>,
    /// `None`: no owner (after a clear).
    pub group: Option<String>,
}

/// `devctl admin reservation add`: exactly one of `gpus` (non-empty) and `node`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewReservation {
    pub name: String,
    pub group: String,
    #[serde(default)]
    pub gpus: Vec<GpuUuid>,
    #[serde(default)]
    pub node: Option<NodeName>,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
}

/// Where a reservation's window stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationStatus {
    Upcoming,
    Active,
    Ended,
}

impl std::fmt::Display for ReservationStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Upcoming => "upcoming",
            Self::Active => "active",
            Self::Ended => "ended",
        })
    }
}

/// A reservation as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationView {
    pub name: String,
    pub group: String,
    /// The node reserved whole, if it was given with `--node`.
    pub node: Option<NodeName>,
    /// The GPUs it holds now (a node's GPUs as registered now).
    pub gpus: Vec<GpuUuid>,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub status: ReservationStatus,
    /// The admin who made it (login name).
    pub created_by: String,
    pub created_at: DateTime<Utc>,
}
