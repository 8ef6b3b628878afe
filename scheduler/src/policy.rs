//! Site policy the planner obeys beyond the hardware: GPUs an owner group owns, and
//! reservations that keep GPUs for one group during a window of time.
//!
//! - **Owned GPUs.** An owned GPU takes its owner group's work first: the owners' waiting
//!   sessions, then their queued jobs, are placed on their free owned GPUs before any other
//!   request is served. Others' batch jobs may start there as *backfill*; when owner work finds
//!   no free place, it halts backfill on its owned GPUs (min duration does not protect
//!   backfill). Others' sessions are never placed on owned GPUs unless
//!   [`Policy::sessions_on_owned_gpus`].
//! - **Reservations.** From `from` until `to` (`from <= now < to`), a reserved GPU takes only its
//!   group's work, and others' jobs running there are halted when the window opens. Before the
//!   window, others' work starts on it only when its max duration ends by `from` (work without
//!   one never does). A request that names a reservation goes only to that reservation's GPUs,
//!   and only while its window is open.
//!
//! Who asks is looked up by id in [`Policy::sessions`] and [`Policy::jobs`]; a request absent
//! there belongs to no group, names no reservation and has no max duration.

use std::collections::{BTreeMap, HashSet};

use chrono::{DateTime, Utc};
use ongrid_core::{GpuUuid, HumanDuration, JobId, SessionId};
use serde::{Deserialize, Serialize};

/// The site's owned GPUs and reservations, and who asks for what.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// The owner group of each owned GPU.
    #[serde(default)]
    pub owners: BTreeMap<GpuUuid, String>,
    /// Whether sessions of other groups may be placed on owned GPUs (they are never halted,
    /// unlike backfill jobs).
    #[serde(default)]
    pub sessions_on_owned_gpus: bool,
    #[serde(default)]
    pub reservations: Vec<Reservation>,
    /// The group, reservation and max duration of each pending session.
    #[serde(default)]
    pub sessions: BTreeMap<SessionId, Access>,
    /// The group, reservation and max duration of each queued or running job.
    #[serde(default)]
    pub jobs: BTreeMap<JobId, Access>,
}

/// GPUs kept for one group's work from `from` until `to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub name: String,
    pub group: String,
    pub gpus: Vec<GpuUuid>,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
}

impl Reservation {
    /// Whether the window is open at `now`: `from <= now < to`.
    pub fn active(&self, now: DateTime<Utc>) -> bool {
        self.from <= now && now < self.to
    }
}

/// Who asks: the owner's accounting group, the reservation named, and how long the work may
/// run once started (a job's max duration, a session's maximum lifetime).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Access {
    pub group: Option<String>,
    pub reservation: Option<String>,
    pub max_duration: Option<HumanDuration>,
}

/// What a GPU is bound by: its owner and the reservations on it that have not ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Tag {
    pub owner: Option<String>,
    /// Indices into the policy's reservations, ascending.
    pub reservations: Vec<usize>,
}

/// Sessions and jobs differ in one rule: only jobs run as backfill on others' GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Session,
    Job,
}

/// One request's rights, resolved for a plan.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Who<'a> {
    pub kind: Kind,
    pub group: Option<&'a str>,
    pub reservation: Option<&'a str>,
    pub max_duration: Option<HumanDuration>,
}

impl<'a> Who<'a> {
    pub fn session(policy: &'a Policy, id: &SessionId) -> Self {
        Self::of(Kind::Session, policy.sessions.get(id))
    }

    pub fn job(policy: &'a Policy, id: &JobId) -> Self {
        Self::of(Kind::Job, policy.jobs.get(id))
    }

    fn of(kind: Kind, access: Option<&'a Access>) -> Self {
        Self {
            kind,
            group: access.and_then(|a| a.group.as_deref()),
            reservation: access.and_then(|a| a.reservation.as_deref()),
            max_duration: access.and_then(|a| a.max_duration),
        }
    }
}

impl Policy {
    /// The GPUs an owner or a reservation not ended at `now` binds: [`Self::tag`] of every
    /// other GPU is the default one.
    pub(crate) fn bound_gpus(&self, now: DateTime<Utc>) -> HashSet<&GpuUuid> {
        let mut bound: HashSet<&GpuUuid> = self.owners.keys().collect();
        for reservation in self.reservations.iter().filter(|r| now < r.to) {
            bound.extend(&reservation.gpus);
        }
        bound
    }

    /// The tag of a GPU at `now`: ended reservations no longer bind it.
    pub(crate) fn tag(&self, uuid: &GpuUuid, now: DateTime<Utc>) -> Tag {
        Tag {
            owner: self.owners.get(uuid).cloned(),
            reservations: self
                .reservations
                .iter()
                .enumerate()
                .filter(|(_, r)| now < r.to && r.gpus.contains(uuid))
                .map(|(i, _)| i)
                .collect(),
        }
    }

    /// Whether `who` may be given a GPU with this tag at `now`.
    pub(crate) fn allows(&self, tag: &Tag, who: &Who<'_>, now: DateTime<Utc>) -> bool {
        let reservations = || tag.reservations.iter().map(|&i| &self.reservations[i]);
        let mine = |r: &Reservation| who.group == Some(r.group.as_str());
        if let Some(name) = who.reservation {
            if !reservations().any(|r| r.name == name && r.active(now)) {
                return false;
            }
        }
        for reservation in reservations().filter(|r| !mine(r)) {
            if reservation.active(now) || !ends_by(now, who.max_duration, reservation.from) {
                return false;
            }
        }
        let reserved_for_me = reservations().any(|r| mine(r) && r.active(now));
        match &tag.owner {
            Some(owner) if who.group != Some(owner.as_str()) => {
                who.kind == Kind::Job || self.sessions_on_owned_gpus || reserved_for_me
            }
            _ => true,
        }
    }

    /// Whether the GPU is owned by `who`'s group.
    pub(crate) fn owned_by(tag: &Tag, who: &Who<'_>) -> bool {
        tag.owner.is_some() && tag.owner.as_deref() == who.group
    }

    /// The reservation whose window is open on this GPU at `now` and that is not `group`'s,
    /// if any: a job of `group` running there must halt.
    pub(crate) fn started_against(
        &self,
        uuid: &GpuUuid,
        group: Option<&str>,
        now: DateTime<Utc>,
    ) -> Option<&Reservation> {
        self.reservations
            .iter()
            .filter(|r| r.active(now) && r.gpus.contains(uuid))
            .filter(|r| group != Some(r.group.as_str()))
            .min_by(|a, b| (a.from, &a.name).cmp(&(b.from, &b.name)))
    }
}

/// Whether work started at `now` that runs at most `duration` ends by `deadline`.
fn ends_by(now: DateTime<Utc>, duration: Option<HumanDuration>, deadline: DateTime<Utc>) -> bool {
    let Some(duration) = duration else {
        return false;
    };
    chrono::Duration::from_std(duration.as_duration())
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .is_some_and(|end| end <= deadline)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{at, uuid};

    fn reservation(name: &str, group: &str, from: i64, to: i64) -> Reservation {
        Reservation {
            name: name.to_owned(),
            group: group.to_owned(),
            gpus: vec![uuid(1)],
            from: at(from),
            to: at(to),
        }
    }

    fn who(kind: Kind, group: &str, max: Option<u64>) -> Who<'_> {
        Who {
            kind,
            group: Some(group),
            reservation: None,
            max_duration: max.map(HumanDuration::from_secs),
        }
    }

    #[test]
    fn a_window_is_open_from_its_start_until_just_before_its_end() {
        let r = reservation("r", "cms", 100, 200);
        assert!(!r.active(at(99)));
        assert!(r.active(at(100)));
        assert!(r.active(at(199)));
        assert!(!r.active(at(200)));
    }

    #[test]
    fn others_work_must_end_by_the_start_of_a_reservation() {
        let policy = Policy {
            reservations: vec![reservation("r", "cms", 100, 200)],
            ..Policy::default()
        };
        let tag = |now| policy.tag(&uuid(1), at(now));
        let job = |max| who(Kind::Job, "atlas", max);
        // Ends exactly at the start: allowed; one second more: not.
        assert!(policy.allows(&tag(40), &job(Some(60)), at(40)));
        assert!(!policy.allows(&tag(40), &job(Some(61)), at(40)));
        // No max duration: never before a reservation of others.
        assert!(!policy.allows(&tag(40), &job(None), at(40)));
        // Within the window: nothing of others; the group's own work: yes.
        assert!(!policy.allows(&tag(100), &job(Some(1)), at(100)));
        assert!(policy.allows(&tag(100), &who(Kind::Job, "cms", None), at(100)));
        // Ended: the GPU is free of it.
        assert!(policy.allows(&tag(200), &job(None), at(200)));
    }

    #[test]
    fn a_request_naming_a_reservation_goes_only_to_its_gpus_in_its_window() {
        let policy = Policy {
            reservations: vec![reservation("r", "cms", 100, 200)],
            ..Policy::default()
        };
        let named = Who {
            reservation: Some("r"),
            ..who(Kind::Session, "cms", None)
        };
        assert!(policy.allows(&policy.tag(&uuid(1), at(150)), &named, at(150)));
        assert!(!policy.allows(&policy.tag(&uuid(2), at(150)), &named, at(150)));
        assert!(!policy.allows(&policy.tag(&uuid(1), at(99)), &named, at(99)));
    }

    #[test]
    fn owned_gpus_take_others_jobs_but_not_their_sessions_unless_allowed() {
        let mut policy = Policy {
            owners: [(uuid(1), "cms".to_owned())].into(),
            ..Policy::default()
        };
        let tag = policy.tag(&uuid(1), at(0));
        assert!(policy.allows(&tag, &who(Kind::Session, "cms", None), at(0)));
        assert!(policy.allows(&tag, &who(Kind::Job, "atlas", None), at(0)));
        assert!(!policy.allows(&tag, &who(Kind::Session, "atlas", None), at(0)));
        policy.sessions_on_owned_gpus = true;
        assert!(policy.allows(&tag, &who(Kind::Session, "atlas", None), at(0)));
    }
}
