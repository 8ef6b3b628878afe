//! Owned GPUs and reservations in the scheduling loop and in what people are shown: loads what
//! admins set ([`crate::store::gpu_policy`]), turns it into the planner's
//! [`ongrid_scheduler::Policy`] (each waiting request's accounting group, reservation and max
//! duration), words why a waiting request is kept off owned or reserved GPUs
//! ([`crate::domain::policy::reservations::waiting_note`]), and says when a running session of
//! another group is held for a reservation on its GPUs ([`GpuPolicy::session_hold`]).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::{Dn, GpuId, GpuRequest, GpuUuid, HumanDuration, SessionId};
use ongrid_scheduler::{Access, Reservation};

use crate::domain::jobs::JobRecord;
use crate::domain::policy::fairshare::Account;
use crate::domain::policy::reservations::{
    reservation_hold, waiting_note, FittingGpu, ReservationName, ReservationRecord, Waiter,
};
use crate::domain::policy::GroupName;
use crate::domain::sessions::holds::{LifecycleConfig, LifecycleFacts};
use crate::domain::sessions::SessionRecord;
use crate::site::SiteSnapshot;
use crate::store::gpu_policy::{Owners, OwnersAndReservations, RequestReservations};
use crate::store::{NodeRecord, Store, StoreResult};

/// What the scheduler needs beyond the store: the site's settings.
#[derive(Debug, Clone, Copy)]
pub struct PolicySettings {
    /// `[policy] sessions_on_owned_gpus`.
    pub sessions_on_owned_gpus: bool,
    /// Sessions' maximum lifetimes: how long a session placed now may hold its GPUs.
    pub lifecycle: LifecycleConfig,
}

/// Owners, reservations and the reservations requests use, as stored.
#[derive(Debug, Clone, Default)]
pub struct GpuPolicy {
    pub owners: Owners,
    pub reservations: Vec<ReservationRecord>,
    pub requests: RequestReservations,
}

/// The accounting group of `dn` as last admitted (`default` before any).
pub fn group_of(accounts: &[Account], dn: &Dn) -> GroupName {
    accounts
        .iter()
        .find(|a| &a.user == dn)
        .map_or_else(GroupName::default_group, |a| a.group.clone())
}

/// The GPUs `session` holds, a MIG device by its parent GPU (as `site`'s nodes report them).
pub fn session_gpus(site: &SiteSnapshot, session: &SessionRecord) -> Vec<GpuUuid> {
    session
        .gpus
        .iter()
        .filter_map(|gpu| match gpu {
            GpuId::Gpu(uuid) => Some(uuid.clone()),
            GpuId::Mig(device) => site
                .nodes
                .iter()
                .flat_map(|node| node.gpus.iter())
                .find(|g| g.info.mig_devices.iter().any(|d| d.uuid == *device))
                .map(|g| g.info.uuid.clone()),
        })
        .collect()
}

fn human(duration: Duration) -> HumanDuration {
    HumanDuration::from_secs(duration.as_secs())
}

impl GpuPolicy {
    /// Loads it as it counts from `now` on: the owners and reservations as the store keeps them
    /// (one statement while neither changed); the reservations requests use are read only when
    /// a reservation has not ended by `now` (no ended one holds a request, [`Self::named`]).
    pub async fn load(store: &dyn Store, now: DateTime<Utc>) -> StoreResult<Self> {
        let policy = store.gpu_policy();
        let OwnersAndReservations {
            owners,
            reservations,
        } = policy.owners_and_reservations().await?;
        let requests = if reservations.iter().any(|r| now < r.to) {
            policy.request_reservations().await?
        } else {
            RequestReservations::default()
        };
        Ok(Self {
            owners,
            reservations,
            requests,
        })
    }

    /// Whether nothing is owned and no reservation is upcoming or active at `now`.
    pub fn is_idle(&self, now: DateTime<Utc>) -> bool {
        self.owners.nodes.is_empty()
            && self.owners.gpus.is_empty()
            && self.reservations.iter().all(|r| r.to <= now)
    }

    /// The owner group of each owned GPU of the site (a GPU's own owner wins over its node's).
    pub fn gpu_owners(&self, site: &SiteSnapshot) -> BTreeMap<GpuUuid, GroupName> {
        let mut owners = BTreeMap::new();
        for node in &site.nodes {
            for gpu in node.gpus.iter() {
                let owner = self
                    .owners
                    .gpus
                    .get(&gpu.info.uuid)
                    .or_else(|| self.owners.nodes.get(&node.name));
                if let Some(owner) = owner {
                    owners.insert(gpu.info.uuid.clone(), owner.clone());
                }
            }
        }
        owners
    }

    /// Each reservation with the GPUs it holds now (a node's GPUs as registered now).
    pub fn reservations_with_gpus(
        &self,
        site: &SiteSnapshot,
    ) -> Vec<(ReservationRecord, Vec<GpuUuid>)> {
        self.reservations_on(&site.nodes)
    }

    /// Each reservation with the GPUs it holds among `nodes` (a node's GPUs as registered).
    pub fn reservations_on(&self, nodes: &[NodeRecord]) -> Vec<(ReservationRecord, Vec<GpuUuid>)> {
        self.reservations
            .iter()
            .map(|r| {
                let gpus = match &r.node {
                    Some(name) => nodes
                        .iter()
                        .filter(|node| node.name == *name)
                        .flat_map(|node| node.gpus.iter().map(|g| g.info.uuid.clone()))
                        .collect(),
                    None => r.gpus.clone(),
                };
                (r.clone(), gpus)
            })
            .collect()
    }

    /// The reservation a request named, while it exists and has not ended.
    fn named(
        &self,
        name: Option<&ReservationName>,
        now: DateTime<Utc>,
    ) -> Option<&ReservationRecord> {
        let name = name?;
        self.reservations
            .iter()
            .find(|r| r.name == *name && now < r.to)
    }

    pub fn session_reservation(
        &self,
        id: SessionId,
        now: DateTime<Utc>,
    ) -> Option<&ReservationRecord> {
        self.named(self.requests.sessions.get(&id), now)
    }

    pub fn job_reservation(
        &self,
        job: &JobRecord,
        now: DateTime<Utc>,
    ) -> Option<&ReservationRecord> {
        self.named(self.requests.chains.get(&job.chain.initial_job), now)
    }

    /// When `session`, of `group`, running on GPUs that a reservation of another group holds,
    /// is held for it ([`reservation_hold`]: the window's start, not sooner than `notice` after
    /// the reservation was added), and that reservation; `None` when none holds its GPUs.
    pub fn session_hold(
        &self,
        site: &SiteSnapshot,
        session: &SessionRecord,
        group: &GroupName,
        notice: Duration,
        now: DateTime<Utc>,
    ) -> Option<(DateTime<Utc>, ReservationRecord)> {
        if self.reservations.iter().all(|r| r.to <= now) {
            return None;
        }
        let reservations = self.reservations_with_gpus(site);
        reservation_hold(
            group,
            &session_gpus(site, session),
            &reservations,
            notice,
            now,
        )
        .map(|hold| (hold.at, hold.reservation.clone()))
    }

    /// The planner's policy for `site`'s pending sessions and active jobs.
    pub fn scheduler_policy(
        &self,
        site: &SiteSnapshot,
        accounts: &[Account],
        pending: &[SessionRecord],
        facts: &[LifecycleFacts],
        settings: &PolicySettings,
        now: DateTime<Utc>,
    ) -> ongrid_scheduler::Policy {
        let sessions = pending
            .iter()
            .map(|session| {
                let max = facts
                    .iter()
                    .find(|f| f.session_id == session.id)
                    .and_then(|f| f.max_duration(&settings.lifecycle).to_std().ok())
                    .unwrap_or(settings.lifecycle.max_duration);
                let access = Access {
                    group: Some(group_of(accounts, &session.owner).to_string()),
                    reservation: self
                        .session_reservation(session.id, now)
                        .map(|r| r.name.to_string()),
                    max_duration: Some(human(max)),
                };
                (session.id, access)
            })
            .collect();
        let jobs = site
            .jobs
            .iter()
            .map(|job| {
                let access = Access {
                    group: Some(group_of(accounts, &job.owner).to_string()),
                    reservation: self.job_reservation(job, now).map(|r| r.name.to_string()),
                    max_duration: job.max_duration,
                };
                (job.id, access)
            })
            .collect();
        ongrid_scheduler::Policy {
            owners: self
                .gpu_owners(site)
                .into_iter()
                .map(|(gpu, owner)| (gpu, owner.to_string()))
                .collect(),
            sessions_on_owned_gpus: settings.sessions_on_owned_gpus,
            reservations: self
                .reservations_with_gpus(site)
                .into_iter()
                .filter(|(r, _)| now < r.to)
                .map(|(r, gpus)| Reservation {
                    name: r.name.to_string(),
                    group: r.group.to_string(),
                    gpus,
                    from: r.from,
                    to: r.to,
                })
                .collect(),
            sessions,
            jobs,
        }
    }

    /// Why a waiting request of `group` is kept off owned or reserved GPUs that would fit it (a
    /// MIG request: GPUs with a MIG device that would).
    pub fn note(
        &self,
        site: &SiteSnapshot,
        request: &GpuRequest,
        waiter: &Waiter<'_>,
        sessions_on_owned_gpus: bool,
        now: DateTime<Utc>,
    ) -> Option<String> {
        let owners = self.gpu_owners(site);
        let fitting: Vec<FittingGpu<'_>> = site
            .nodes
            .iter()
            .flat_map(|node| node.gpus.iter())
            .filter(|gpu| crate::site::fits(gpu, request))
            .map(|gpu| FittingGpu {
                uuid: &gpu.info.uuid,
                owner: owners.get(&gpu.info.uuid),
            })
            .collect();
        waiting_note(
            waiter,
            &fitting,
            &self.reservations_with_gpus(site),
            sessions_on_owned_gpus,
            now,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fixtures;

    /// What a session's request names is read, and resolves, while its reservation has not
    /// ended; once every reservation has, the requests are not read, and would not resolve.
    #[tokio::test]
    async fn requests_are_read_while_a_reservation_has_not_ended() {
        let (_dir, store) = fixtures::sqlite().await;
        let start = DateTime::UNIX_EPOCH + chrono::TimeDelta::days(20_000);
        let hours = |h| start + chrono::TimeDelta::hours(h);
        let name = ReservationName::parse("course").unwrap();
        let record = ReservationRecord {
            name: name.clone(),
            group: GroupName::parse("atlas").unwrap(),
            node: None,
            gpus: vec![fixtures::gpu(1).uuid],
            from: hours(1),
            to: hours(3),
            created_by: ongrid_core::UserName::parse("root").unwrap(),
            created_at: start,
        };
        let policy = store.gpu_policy();
        assert!(policy.add_reservation(&record).await.unwrap());
        let owner = Dn::parse("/DC=org/DC=example/CN=Alice").unwrap();
        store.user(&owner, 20_000).await.unwrap();
        let new = fixtures::new_session(&owner, start);
        policy.set_session_reservation(new.id, &name).await.unwrap();
        let session = store.create_session(new).await.unwrap();

        for (at, read) in [(0, true), (2, true), (3, false), (5, false)] {
            let loaded = GpuPolicy::load(store.as_ref(), hours(at)).await.unwrap();
            assert_eq!(
                loaded.requests.sessions.contains_key(&session.id),
                read,
                "at hour {at}"
            );
            let resolved = loaded.session_reservation(session.id, hours(at));
            assert_eq!(
                resolved.map(|r| &r.name),
                read.then_some(&name),
                "at hour {at}"
            );
        }
    }
}
