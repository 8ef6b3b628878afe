//! Phase 2 of a round: running sessions of other groups on GPUs of a reservation are HELD once
//! their hold is due, so the plan gives the group their GPUs (others' jobs there are halted by
//! the plan itself).

use chrono::{DateTime, Utc};

use super::gpu_policy::{group_of, GpuPolicy};
use super::{Reads, Scheduler};
use crate::domain::policy::reservations::{hold_change, ReservationHold};
use crate::site::SiteSnapshot;
use crate::store::StoreResult;

impl Scheduler {
    /// Holds the running sessions of other groups on GPUs of a reservation once their hold is
    /// due: at the window's start, not sooner than `[lifecycle] warn_before` after the
    /// reservation was added (`domain::policy::reservations::reservation_hold`), so connected
    /// terminals were warned. Their jobs are halted by the plan. Returns how many it held.
    pub(super) async fn hold_for_reservations(
        &self,
        site: &SiteSnapshot,
        policy: &GpuPolicy,
        reads: &mut Reads<'_>,
        now: DateTime<Utc>,
    ) -> StoreResult<usize> {
        if site.holding.is_empty() {
            return Ok(0);
        }
        if policy.reservations.iter().all(|r| r.to <= now) {
            return Ok(0);
        }
        let accounts = reads.accounts().await?;
        let notice = self
            .gpu_policy
            .map_or_else(Default::default, |settings| settings.lifecycle)
            .warn_before;
        let mut held = 0;
        for session in &site.holding {
            let group = group_of(accounts, &session.owner);
            let Some((at, reservation)) = policy.session_hold(site, session, &group, notice, now)
            else {
                continue;
            };
            if at > now {
                continue;
            }
            let hold = ReservationHold {
                reservation: &reservation,
                at,
            };
            if self
                .apply(session.id, hold_change(&session.name, &hold, now))
                .await?
            {
                tracing::info!(session_id = %session.id, session = %session.name, user = %session.user_name,
                    reservation = %reservation.name, group = %reservation.group,
                    "Session held: a reservation of another group started on its GPUs.");
                crate::metrics::events().held(ongrid_core::holds::HoldReason::Admin);
                held += 1;
            }
        }
        Ok(held)
    }
}
