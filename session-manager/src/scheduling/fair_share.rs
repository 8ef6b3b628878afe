//! Fair share in the scheduling loop: every round charges each user's account for the GPUs
//! they hold (sessions and jobs, cost-weighted, see [`crate::domain::policy::fairshare`]),
//! stores it, and gives the scheduler each waiting request's [`Priority`] from its owner's
//! standing. Only with a `[fairshare]` section; without one the queue is first come, first
//! served.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use ongrid_core::{Dn, GpuId, GpuRequest, Sharing};
use ongrid_scheduler::{Priority, SiteState};

use crate::domain::jobs::JobRecord;
use crate::domain::policy::fairshare::{
    advance, mig_fraction, priority, standings, Account, FairShareConfig, GroupStanding,
};
use crate::domain::policy::GroupName;
use crate::domain::sessions::SessionRecord;
use crate::site::SiteSnapshot;
use crate::store::{Store, StoreResult};

/// The cost-weighted GPUs `gpus` (asked for with `request`) stand for on this site.
fn weighted(
    site: &SiteSnapshot,
    config: &FairShareConfig,
    request: &GpuRequest,
    gpus: &[GpuId],
) -> f64 {
    gpus.iter()
        .map(|gpu| match gpu {
            GpuId::Gpu(uuid) => site
                .nodes
                .iter()
                .flat_map(|node| node.gpus.iter())
                .find(|record| &record.info.uuid == uuid)
                .map_or(1.0, |record| {
                    let places = if request.sharing == Sharing::Exclusive {
                        1
                    } else {
                        record.mode.capacity().max(1)
                    };
                    config.weight(&record.info.model) / f64::from(places)
                }),
            GpuId::Mig(mig) => site
                .nodes
                .iter()
                .flat_map(|node| node.gpus.iter())
                .find_map(|record| {
                    let device = record.info.mig_devices.iter().find(|d| &d.uuid == mig)?;
                    let model = &record.info.model;
                    Some(config.weight(model) * mig_fraction(model, device.profile))
                })
                // A device no longer reported: the smallest slice of a GPU of weight 1.
                .unwrap_or(1.0 / 7.0),
        })
        .sum()
}

/// Charges `accounts` (as the store has them) to `now` for what each user holds in `site`,
/// stores them and returns them.
pub async fn meter(
    store: &dyn Store,
    config: &FairShareConfig,
    site: &SiteSnapshot,
    mut accounts: Vec<Account>,
    now: DateTime<Utc>,
) -> StoreResult<Vec<Account>> {
    let mut holding: HashMap<&Dn, f64> = HashMap::new();
    for session in &site.holding {
        *holding.entry(&session.owner).or_default() +=
            weighted(site, config, &session.request, &session.gpus);
    }
    for job in site.jobs.iter().filter(|j| j.state().holds_gpus()) {
        *holding.entry(&job.owner).or_default() +=
            weighted(site, config, &job.spec.gpus, &job.gpus);
    }
    for user in holding.keys() {
        if !accounts.iter().any(|a| &a.user == *user) {
            // Admitted before accounting groups were recorded: counted in `default`.
            accounts.push(Account {
                user: (*user).clone(),
                group: GroupName::default_group(),
                usage: 0.0,
                updated_at: now,
            });
        }
    }
    for account in &mut accounts {
        let held = holding.get(&account.user).copied().unwrap_or(0.0);
        account.usage = advance(account, held, now, config.half_life);
        account.updated_at = now.max(account.updated_at);
    }
    store.save_usage(&accounts).await?;
    Ok(accounts)
}

/// Sets each pending session's and queued job's priority in `state` from its owner's standing.
pub fn prioritise(
    state: &mut SiteState,
    accounts: &[Account],
    standings: &[GroupStanding],
    pending: &[SessionRecord],
    jobs: &[std::sync::Arc<JobRecord>],
) {
    let of = |dn: &Dn| owner_priority(accounts, standings, dn);
    for queued in &mut state.pending {
        if let Some(session) = pending.iter().find(|s| s.id == queued.id) {
            queued.priority = of(&session.owner);
        }
    }
    for queued in &mut state.queued_jobs {
        if let Some(job) = jobs.iter().find(|j| j.id == queued.id) {
            queued.priority = of(&job.owner);
        }
    }
}

/// The priority of `owner`'s waiting work: their group's standing, then their own usage.
fn owner_priority(accounts: &[Account], standings: &[GroupStanding], owner: &Dn) -> Priority {
    let group = accounts
        .iter()
        .find(|a| &a.user == owner)
        .map_or_else(GroupName::default_group, |a| a.group.clone());
    priority(standings, &group, owner)
}

/// Waiting work in the order the scheduler serves it (`ongrid_scheduler::plan`): by its
/// owner's fair-share priority when `[fairshare]` is on (`config`), then by the time it was
/// queued. `waiting` is each request's (owner, queued at, id), in any order; the queue
/// positions `devctl session show` and `devctl job show` print come from this.
pub fn serve_order<Id: Ord + Copy>(
    waiting: &[(Dn, DateTime<Utc>, Id)],
    accounts: &[Account],
    config: Option<&FairShareConfig>,
) -> Vec<Id> {
    let waiting = waiting.iter().map(|(owner, at, id)| (owner, *at, *id));
    let mut keyed = serve_keys(waiting, accounts, config);
    keyed.sort();
    keyed.into_iter().map(|(_, _, id)| id).collect()
}

/// The 1-based place of `target` in [`serve_order`] of `waiting` (which holds it), counted
/// without ordering the rest: a job's answer places it among thousands queued.
pub fn serve_place<'a, Id: Ord + Copy>(
    target: Id,
    waiting: impl IntoIterator<Item = (&'a Dn, DateTime<Utc>, Id)>,
    accounts: &[Account],
    config: Option<&FairShareConfig>,
) -> Option<u32> {
    let keyed = serve_keys(waiting, accounts, config);
    let key = *keyed.iter().find(|(_, _, id)| *id == target)?;
    let ahead = keyed.iter().filter(|other| **other < key).count();
    u32::try_from(ahead + 1).ok()
}

/// Each waiting request's key in the order served: its owner's priority (worked out once per
/// owner), the time it was queued, its id.
fn serve_keys<'a, Id>(
    waiting: impl IntoIterator<Item = (&'a Dn, DateTime<Utc>, Id)>,
    accounts: &[Account],
    config: Option<&FairShareConfig>,
) -> Vec<(Priority, DateTime<Utc>, Id)> {
    let standings = config.map(|config| standings(accounts, config));
    let mut priorities: HashMap<&Dn, Priority> = HashMap::new();
    waiting
        .into_iter()
        .map(|(owner, queued_at, id)| {
            let priority = *priorities.entry(owner).or_insert_with(|| {
                standings
                    .as_deref()
                    .map(|standings| owner_priority(accounts, standings, owner))
                    .unwrap_or_default()
            });
            (priority, queued_at, id)
        })
        .collect()
}

/// The standings as of the stored accounts, decayed to `now` (for `devctl share`).
pub fn current(
    accounts: &[Account],
    config: &FairShareConfig,
    now: DateTime<Utc>,
) -> Vec<GroupStanding> {
    let decayed: Vec<Account> = accounts
        .iter()
        .map(|a| Account {
            usage: advance(a, 0.0, now, config.half_life),
            updated_at: now,
            ..a.clone()
        })
        .collect();
    standings(&decayed, config)
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn dn(cn: &str) -> Dn {
        Dn::parse(&format!("/DC=org/DC=example/CN={cn}")).unwrap()
    }

    #[test]
    fn waiting_work_is_served_by_fair_share_then_by_time_queued() {
        let at = |minute| Utc.with_ymd_and_hms(2026, 11, 26, 8, minute, 0).unwrap();
        let (heavy, light) = (dn("Heavy User"), dn("Light User"));
        let group = GroupName::default_group();
        let accounts = [
            Account {
                user: heavy.clone(),
                group: group.clone(),
                usage: 40.0,
                updated_at: at(0),
            },
            Account {
                user: light.clone(),
                group,
                usage: 2.0,
                updated_at: at(0),
            },
        ];
        // The heavy user's two requests came first, the light user's last.
        let waiting = [
            (heavy.clone(), at(1), 1u32),
            (heavy, at(2), 2),
            (light, at(3), 3),
        ];

        let config = FairShareConfig::default();
        assert_eq!(serve_order(&waiting, &accounts, Some(&config)), [3, 1, 2]);
        // Without [fairshare], first come, first served.
        assert_eq!(serve_order(&waiting, &accounts, None), [1, 2, 3]);
        // Each one's place, counted alone, is its place in the order.
        let listed = || waiting.iter().map(|(owner, at, id)| (owner, *at, *id));
        let places = [1u32, 2, 3].map(|id| serve_place(id, listed(), &accounts, Some(&config)));
        assert_eq!(places, [Some(2), Some(3), Some(1)]);
        assert_eq!(serve_place(3, listed(), &accounts, None), Some(3));
        assert_eq!(serve_place(4, listed(), &accounts, None), None);
    }
}
