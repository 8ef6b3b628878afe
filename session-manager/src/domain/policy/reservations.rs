//! Owned GPUs and reservations (site policy): which reservations an admin may add, who may use
//! one and when, and why a waiting request is kept off owned or reserved GPUs.
//!
//! An admin gives a GPU or a whole node an owner group (`devctl admin gpu owner`, `admin node
//! owner`; a GPU's own owner wins over its node's), and reserves GPUs or a node for a group
//! from one time to another (`devctl admin reservation add`). What the scheduler then does
//! with them is `ongrid_scheduler`'s `policy.rs`: owners' work first on owned GPUs, others'
//! jobs only as backfill halted for owner work, others' sessions not at all unless
//! `[policy] sessions_on_owned_gpus`; reserved GPUs only for the group's work in the window,
//! others' jobs halted when it opens and not started when their max duration would reach it.
//!
//! Others' interactive sessions already running on a reserved GPU when the window opens (the
//! reservation was added while they ran) are held ([`reservation_hold`], [`hold_change`]),
//! like an admin's hold: HELD with the reservation and its start named, their container kept,
//! `devctl session release` puts them back in the queue. The grace: a session is held at the
//! window's start, but never sooner than `[lifecycle] warn_before` after the reservation was
//! added, so every connected terminal gets the hold warning ahead, as for any planned hold
//! (Slurm's reservations and maintenance windows likewise warn ahead and start no work that would
//! overlap them). Until then the hold is shown as planned in the session's deadlines.

use std::fmt;

use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::reservation::{ReservationStatus, ReservationView};
use ongrid_core::{GpuUuid, NodeName, SessionName, UserName};

use super::GroupName;
use crate::domain::sessions::Change;
use crate::domain::{utc, Refusal};

/// A reservation's name: lower-case letters, digits, `-`, `_` and `.`, 1 to 64 characters,
/// starting with a letter or digit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReservationName(String);

impl ReservationName {
    pub fn parse(value: &str) -> Result<Self, String> {
        if super::admission::is_policy_name(value, 64) {
            Ok(Self(value.to_owned()))
        } else {
            Err(format!(
                "reservation name {value:?} must be 1 to 64 lower-case letters, digits, '-', '_' \
                 or '.', starting with a letter or digit, like cms-school"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ReservationName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stored reservation. `gpus` are the GPUs named at creation; a reservation of a whole node
/// has `node` and no GPUs of its own (it holds whatever GPUs the node has).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationRecord {
    pub name: ReservationName,
    pub group: GroupName,
    pub node: Option<NodeName>,
    pub gpus: Vec<GpuUuid>,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub created_by: UserName,
    pub created_at: DateTime<Utc>,
}

impl ReservationRecord {
    pub fn status(&self, now: DateTime<Utc>) -> ReservationStatus {
        if now < self.from {
            ReservationStatus::Upcoming
        } else if now < self.to {
            ReservationStatus::Active
        } else {
            ReservationStatus::Ended
        }
    }

    /// The API's view, with the GPUs it holds now (`gpus`: a node's GPUs as registered).
    pub fn view(&self, gpus: Vec<GpuUuid>, now: DateTime<Utc>) -> ReservationView {
        ReservationView {
            name: self.name.to_string(),
            group: self.group.to_string(),
            node: self.node.clone(),
            gpus,
            from: self.from,
            to: self.to,
            status: self.status(now),
            created_by: self.created_by.to_string(),
            created_at: self.created_at,
        }
    }
}

/// Whether an admin may add `new` (its GPUs as `new_gpus`) next to the `existing`
/// reservations (each with the GPUs it holds now): a window that ends after it starts and has
/// not ended, a free name, and no GPU reserved twice at the same time.
pub fn check_new(
    new: &ReservationRecord,
    new_gpus: &[GpuUuid],
    existing: &[(ReservationRecord, Vec<GpuUuid>)],
    now: DateTime<Utc>,
) -> Result<(), Refusal> {
    if new.to <= new.from {
        return Err(Refusal::Invalid(format!(
            "--to {} must be after --from {}",
            utc(new.to),
            utc(new.from)
        )));
    }
    if new.to <= now {
        return Err(Refusal::Invalid(format!(
            "the window ends at {}, which has passed: give a --to in the future",
            utc(new.to)
        )));
    }
    if new_gpus.is_empty() {
        return Err(Refusal::Invalid(
            "the reservation would hold no GPU: name GPUs with --gpus or a node that has GPUs \
             with --node"
                .to_owned(),
        ));
    }
    for (other, gpus) in existing {
        if other.name == new.name {
            return Err(Refusal::Conflict(format!(
                "reservation {} already exists (group {}, {} to {}): pick another name or \
                 `devctl admin reservation rm {}` first",
                other.name,
                other.group,
                utc(other.from),
                utc(other.to),
                other.name
            )));
        }
        let overlaps = other.from < new.to && new.from < other.to;
        if let Some(gpu) = new_gpus
            .iter()
            .find(|g| gpus.contains(g))
            .filter(|_| overlaps)
        {
            return Err(Refusal::Conflict(format!(
                "{gpu} is already reserved by {} for group {} from {} to {}: choose other GPUs or \
                 times, or remove that reservation first",
                other.name,
                other.group,
                utc(other.from),
                utc(other.to)
            )));
        }
    }
    Ok(())
}

/// Whether a user of `group` may use the reservation `name` (found as `reservation`) at
/// `now`, for a session or job.
pub fn may_use<'a>(
    reservation: Option<&'a ReservationRecord>,
    name: &str,
    group: &GroupName,
    now: DateTime<Utc>,
) -> Result<&'a ReservationRecord, Refusal> {
    let Some(reservation) = reservation else {
        return Err(Refusal::Invalid(format!(
            "there is no reservation {name}: `devctl admin reservation ls` lists them"
        )));
    };
    if reservation.group != *group {
        return Err(Refusal::Forbidden(format!(
            "reservation {} is for group {}, and you use the site in group {group}: ask the \
             site's admins to add you to {} or leave out --reservation",
            reservation.name, reservation.group, reservation.group
        )));
    }
    match reservation.status(now) {
        ReservationStatus::Active => Ok(reservation),
        ReservationStatus::Upcoming => Err(Refusal::Conflict(format!(
            "reservation {} starts at {} (until {}): ask again then, or leave out --reservation",
            reservation.name,
            utc(reservation.from),
            utc(reservation.to)
        ))),
        ReservationStatus::Ended => Err(Refusal::Conflict(format!(
            "reservation {} ended at {}: leave out --reservation",
            reservation.name,
            utc(reservation.to)
        ))),
    }
}

/// A GPU that meets a waiting request's requirements, with what binds it.
#[derive(Debug, Clone, Copy)]
pub struct FittingGpu<'a> {
    pub uuid: &'a GpuUuid,
    pub owner: Option<&'a GroupName>,
}

/// Who waits, as the waiting note needs it.
#[derive(Debug, Clone, Copy)]
pub struct Waiter<'a> {
    pub group: &'a GroupName,
    pub session: bool,
    pub reservation: Option<&'a ReservationRecord>,
    /// How long its work may run once started (sessions: their maximum lifetime).
    pub max_duration: Option<std::time::Duration>,
}

/// Why a waiting request is kept off some of the GPUs that would fit it, naming the owner
/// group or the reservation; `None` when nothing binds them.
pub fn waiting_note(
    waiter: &Waiter<'_>,
    fitting: &[FittingGpu<'_>],
    reservations: &[(ReservationRecord, Vec<GpuUuid>)],
    sessions_on_owned_gpus: bool,
    now: DateTime<Utc>,
) -> Option<String> {
    if let Some(reservation) = waiter.reservation {
        return Some(format!(
            "waits for a GPU of reservation {} (group {}, until {})",
            reservation.name,
            reservation.group,
            utc(reservation.to)
        ));
    }
    let mut notes = Vec::new();
    let owned: Vec<&GroupName> = fitting
        .iter()
        .filter_map(|gpu| gpu.owner)
        .filter(|owner| *owner != waiter.group)
        .collect();
    if waiter.session && !sessions_on_owned_gpus && !owned.is_empty() {
        let mut groups: Vec<&str> = owned.iter().map(|g| g.as_str()).collect();
        groups.sort_unstable();
        groups.dedup();
        notes.push(format!(
            "{} that fit are owned by group {}, whose work goes first there (other groups' \
             sessions are not placed on them)",
            gpus(owned.len()),
            groups.join(", ")
        ));
    }
    for (reservation, gpus_held) in reservations {
        if reservation.group == *waiter.group || reservation.to <= now {
            continue;
        }
        let held = fitting
            .iter()
            .filter(|gpu| gpus_held.contains(gpu.uuid))
            .count();
        if held == 0 {
            continue;
        }
        let ends_in_time = waiter
            .max_duration
            .and_then(|d| chrono::Duration::from_std(d).ok())
            .and_then(|d| now.checked_add_signed(d))
            .is_some_and(|end| end <= reservation.from);
        if reservation.from <= now || !ends_in_time {
            notes.push(format!(
                "{} reserved for group {} by reservation {} from {} to {}",
                gpus(held),
                reservation.group,
                reservation.name,
                utc(reservation.from),
                utc(reservation.to)
            ));
        }
    }
    (!notes.is_empty()).then(|| format!("waits: {}", notes.join("; ")))
}

/// A running session of another group that a reservation holds GPUs of: when it is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationHold<'a> {
    pub reservation: &'a ReservationRecord,
    /// The window's start, or `notice` after the reservation was added when that is later.
    pub at: DateTime<Utc>,
}

/// The reservation of another group than `group` that holds one of `gpus` (a session's GPUs,
/// MIG devices by their parent GPU) and has not ended at `now`, with when a session there is
/// held for it: the earliest such hold. `reservations` come with the GPUs they hold now.
pub fn reservation_hold<'a>(
    group: &GroupName,
    gpus: &[GpuUuid],
    reservations: &'a [(ReservationRecord, Vec<GpuUuid>)],
    notice: std::time::Duration,
    now: DateTime<Utc>,
) -> Option<ReservationHold<'a>> {
    let notice = chrono::Duration::from_std(notice).unwrap_or(chrono::Duration::MAX);
    reservations
        .iter()
        .filter(|(r, held)| {
            r.group != *group && now < r.to && gpus.iter().any(|gpu| held.contains(gpu))
        })
        .map(|(r, _)| ReservationHold {
            reservation: r,
            at: r
                .from
                .max(r.created_at.checked_add_signed(notice).unwrap_or(r.to)),
        })
        .filter(|hold| hold.at < hold.reservation.to)
        .min_by(|a, b| (a.at, &a.reservation.name).cmp(&(b.at, &b.reservation.name)))
}

/// The hold of `session` for a reservation whose hold is due: HELD like an admin's hold (the
/// site's admins reserved the GPUs), its reason naming the reservation, its group, when it
/// started and what to do.
pub fn hold_change(
    session: &SessionName,
    hold: &ReservationHold<'_>,
    now: DateTime<Utc>,
) -> Change {
    let r = hold.reservation;
    Change::hold(
        HoldReason::Admin,
        now,
        format!(
            "reservation {} of group {} started at {} on its GPUs, which are that group's until \
             {}: `devctl session release {session}` then, or start a new session elsewhere",
            r.name,
            r.group,
            utc(r.from),
            utc(r.to)
        ),
    )
}

fn gpus(n: usize) -> String {
    if n == 1 {
        "1 GPU".to_owned()
    } else {
        format!("{n} GPUs")
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn t(hour: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 1, hour, 0, 0).unwrap()
    }

    fn gpu(n: u32) -> GpuUuid {
        GpuUuid::parse(&format!("GPU-{n:08x}-0000-0000-0000-000000000000")).unwrap()
    }

    fn group(name: &str) -> GroupName {
        GroupName::parse(name).unwrap()
    }

    fn reservation(name: &str, from: u32, to: u32) -> ReservationRecord {
        ReservationRecord {
            name: ReservationName::parse(name).unwrap(),
            group: group("cms"),
            node: None,
            gpus: vec![gpu(1)],
            from: t(from),
            to: t(to),
            created_by: UserName::parse("root").unwrap(),
            created_at: t(0),
        }
    }

    #[test]
    fn a_new_reservation_needs_a_window_ahead_a_free_name_and_free_gpus() {
        let existing = vec![(reservation("school", 10, 12), vec![gpu(1)])];
        let ok = reservation("other", 12, 14);
        assert_eq!(check_new(&ok, &[gpu(1)], &existing, t(1)), Ok(()));
        let backwards = reservation("back", 14, 12);
        assert!(matches!(
            check_new(&backwards, &[gpu(2)], &existing, t(1)),
            Err(Refusal::Invalid(m)) if m.contains("must be after")
        ));
        let past = reservation("past", 1, 2);
        assert!(matches!(
            check_new(&past, &[gpu(2)], &existing, t(3)),
            Err(Refusal::Invalid(m)) if m.contains("has passed")
        ));
        let taken = reservation("school", 20, 21);
        assert!(matches!(
            check_new(&taken, &[gpu(2)], &existing, t(1)),
            Err(Refusal::Conflict(m)) if m.contains("already exists")
        ));
        let overlapping = reservation("clash", 11, 13);
        assert_eq!(
            check_new(&overlapping, &[gpu(2), gpu(1)], &existing, t(1)),
            Err(Refusal::Conflict(
                "GPU-00000001-0000-0000-0000-000000000000 is already reserved by school for group \
                 cms from 2026-12-01 10:00:00 UTC to 2026-12-01 12:00:00 UTC: choose other GPUs \
                 or times, or remove that reservation first"
                    .to_owned()
            ))
        );
        assert!(check_new(&overlapping, &[], &existing, t(1)).is_err());
    }

    #[test]
    fn only_the_group_uses_a_reservation_and_only_in_its_window() {
        let r = reservation("school", 10, 12);
        assert!(may_use(Some(&r), "school", &group("cms"), t(10)).is_ok());
        assert_eq!(
            may_use(Some(&r), "school", &group("atlas"), t(10)),
            Err(Refusal::Forbidden(
                "reservation school is for group cms, and you use the site in group atlas: ask \
                 the site's admins to add you to cms or leave out --reservation"
                    .to_owned()
            ))
        );
        assert_eq!(
            may_use(Some(&r), "school", &group("cms"), t(9)),
            Err(Refusal::Conflict(
                "reservation school starts at 2026-12-01 10:00:00 UTC (until 2026-12-01 12:00:00 \
                 UTC): ask again then, or leave out --reservation"
                    .to_owned()
            ))
        );
        assert!(matches!(
            may_use(Some(&r), "school", &group("cms"), t(12)),
            Err(Refusal::Conflict(m)) if m.contains("ended at")
        ));
        assert!(matches!(
            may_use(None, "nope", &group("cms"), t(10)),
            Err(Refusal::Invalid(m)) if m.contains("no reservation nope")
        ));
    }

    #[test]
    fn others_sessions_are_held_at_the_window_but_never_before_the_notice() {
        const TEN_MINUTES: std::time::Duration = std::time::Duration::from_secs(600);
        let atlas = group("atlas");
        // Added at 00:00 for 10:00 to 12:00 on GPU 1.
        let reservations = vec![(reservation("school", 10, 12), vec![gpu(1)])];
        let hold = |group: &GroupName, gpus: &[GpuUuid], now| {
            reservation_hold(group, gpus, &reservations, TEN_MINUTES, now).map(|h| h.at)
        };
        assert_eq!(hold(&atlas, &[gpu(2), gpu(1)], t(3)), Some(t(10)));
        // Not the group's own sessions, not other GPUs, not once the window ended.
        assert_eq!(hold(&group("cms"), &[gpu(1)], t(10)), None);
        assert_eq!(hold(&atlas, &[gpu(2)], t(10)), None);
        assert_eq!(hold(&atlas, &[gpu(1)], t(12)), None);
        // Added at 10:00 for a window from 10:00: held ten minutes later, after the warning.
        let mut sudden = reservation("sudden", 10, 12);
        sudden.created_at = t(10);
        let reservations = vec![(sudden, vec![gpu(1)])];
        let held = reservation_hold(&atlas, &[gpu(1)], &reservations, TEN_MINUTES, t(10));
        let held = held.expect("held");
        assert_eq!(held.at, t(10) + chrono::Duration::minutes(10));
        let change = hold_change(&SessionName::parse("train1").unwrap(), &held, held.at);
        assert_eq!(change.hold, Some(HoldReason::Admin));
        assert_eq!(
            change.sentence(),
            "admin: reservation sudden of group cms started at 2026-12-01 10:00:00 UTC on its \
             GPUs, which are that group's until 2026-12-01 12:00:00 UTC: `devctl session release \
             train1` then, or start a new session elsewhere"
        );
    }

    #[test]
    fn a_waiting_note_names_the_owner_and_the_reservation() {
        let cms = group("cms");
        let atlas = group("atlas");
        let fitting = [
            FittingGpu {
                uuid: &gpu(1),
                owner: Some(&cms),
            },
            FittingGpu {
                uuid: &gpu(2),
                owner: None,
            },
        ];
        let waiter = Waiter {
            group: &atlas,
            session: true,
            reservation: None,
            max_duration: Some(std::time::Duration::from_secs(3600)),
        };
        let reservations = vec![(reservation("school", 10, 12), vec![gpu(2)])];
        assert_eq!(
            waiting_note(&waiter, &fitting, &reservations, false, t(10)).as_deref(),
            Some(
                "waits: 1 GPU that fit are owned by group cms, whose work goes first there \
                 (other groups' sessions are not placed on them); 1 GPU reserved for group cms \
                 by reservation school from 2026-12-01 10:00:00 UTC to 2026-12-01 12:00:00 UTC"
            )
        );
        // A job may backfill owned GPUs, and one hour ends before the window opens.
        let job = Waiter {
            session: false,
            ..waiter
        };
        assert_eq!(
            waiting_note(&job, &fitting, &reservations, false, t(8)),
            None
        );
        // The owners themselves are not told about their own GPUs.
        let owner = Waiter {
            group: &cms,
            ..waiter
        };
        assert_eq!(
            waiting_note(&owner, &fitting, &reservations, false, t(10)),
            None
        );
        let r = reservation("school", 10, 12);
        let named = Waiter {
            reservation: Some(&r),
            ..owner
        };
        assert_eq!(
            waiting_note(&named, &fitting, &reservations, false, t(10)).as_deref(),
            Some(
                "waits for a GPU of reservation school (group cms, until 2026-12-01 12:00:00 UTC)"
            )
        );
    }
}
