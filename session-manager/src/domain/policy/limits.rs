//! Limits per user and per accounting group: most GPUs held at once by sessions, by jobs, and
//! by both together, and most sessions holding GPUs at once (`[limits]`); and, CHTC's way, by
//! how long work may hold its GPUs (`[limits.length_classes]`, [`LengthClasses`]): short work
//! (up to `short`, 12 hours) may use all open capacity, work longer than that at most a
//! fraction of the site's GPUs, and long work (longer than `medium`, 24 hours, up to `long`,
//! 7 days) at most a number of GPUs; work longer than `long` is not taken.
//!
//! A request's length is the longest it may hold GPUs: a job's max duration, a session's
//! maximum lifetime (its own `max_duration` or the site's `[lifecycle] max_duration`: the hold
//! policy holds it that long after it first started, held time included, so no session holds
//! GPUs longer). The class follows from that declared bound alone, not from the clock: a long
//! job stays long work until it ends, as in CHTC's classes.
//!
//! Each scheduling round, the waiting requests are taken in the order the scheduler serves them;
//! one is offered to the plan only when its GPUs fit every applicable limit's headroom after
//! what is held and what was offered before it, so whatever subset the plan places, no limit is
//! ever exceeded. The others wait with the limit named ([`Blocked`]). A request larger than a
//! limit could ever allow, or longer than the longest class, is refused when it is made
//! ([`never_fits`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use ongrid_core::{Dn, HumanDuration};

use super::GroupName;

/// The maxima of one user or one group; `None`: no limit (as written in `[limits]`, a key left
/// out).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// GPUs held by sessions and jobs together.
    pub max_gpus: Option<u32>,
    pub max_session_gpus: Option<u32>,
    pub max_job_gpus: Option<u32>,
    /// Sessions holding GPUs (running, starting or waiting for a connection).
    pub max_sessions: Option<u32>,
}

/// The validated `[limits]` section.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LimitsConfig {
    /// Every user's.
    pub user: Limit,
    /// Every group's, unless `groups` names it.
    pub group: Limit,
    pub groups: BTreeMap<GroupName, Limit>,
    /// `[limits.length_classes]`; `None` (the section left out): work of any length is alike.
    pub length_classes: Option<LengthClasses>,
}

impl LimitsConfig {
    fn group_limit(&self, group: &GroupName) -> Limit {
        self.groups.get(group).copied().unwrap_or(self.group)
    }
}

/// Whose GPUs a length class's maximum counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LengthScope {
    /// Each user's (CHTC's per-user limitation).
    User,
    /// Each accounting group's.
    Group,
    /// Everyone's together.
    Site,
}

impl LengthScope {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "user" => Some(Self::User),
            "group" => Some(Self::Group),
            "site" => Some(Self::Site),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Group => "group",
            Self::Site => "site",
        }
    }
}

/// How long work is, by the longest it may hold its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LengthClass {
    Short,
    Medium,
    Long,
}

impl LengthClass {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Short => "short",
            Self::Medium => "medium",
            Self::Long => "long",
        }
    }
}

/// The validated `[limits.length_classes]`: short work (at most `short`) has no cap; work
/// longer than `short` (medium and long together) holds at most `medium_max_fraction` of the
/// site's GPUs, so the rest is always there for short work; work longer than `medium` (long, at
/// most `long`) at most `long_max_gpus`; each counted per `per`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LengthClasses {
    pub short: Duration,
    pub medium: Duration,
    pub long: Duration,
    /// In (0, 1].
    pub medium_max_fraction: f64,
    /// At least 1.
    pub long_max_gpus: u32,
    pub per: LengthScope,
}

impl LengthClasses {
    /// CHTC's GPU Lab classes: short up to 12 hours, medium up to 24 hours with at most a third
    /// of the GPUs, long up to 7 days with at most 4 GPUs, per user.
    pub const CHTC: Self = Self {
        short: Duration::from_secs(12 * 3600),
        medium: Duration::from_secs(24 * 3600),
        long: Duration::from_secs(7 * 86_400),
        medium_max_fraction: 1.0 / 3.0,
        long_max_gpus: 4,
        per: LengthScope::User,
    };

    /// The class of work that may hold GPUs for `length` (`None`: without end); `None` when it
    /// is longer than `long`, so no class takes it.
    pub fn class(&self, length: Option<Duration>) -> Option<LengthClass> {
        match length? {
            length if length <= self.short => Some(LengthClass::Short),
            length if length <= self.medium => Some(LengthClass::Medium),
            length if length <= self.long => Some(LengthClass::Long),
            _ => None,
        }
    }

    /// The most GPUs work longer than `short` may hold on a site of `site_gpus` GPUs: the
    /// fraction of them rounded down, and at least one, so such work can run on any site.
    pub fn medium_max_gpus(&self, site_gpus: u32) -> u32 {
        // The fraction is in (0, 1], so the product fits in a u32.
        let share = (f64::from(site_gpus) * self.medium_max_fraction + 1e-9).floor();
        (share as u32).max(1)
    }
}

/// What one user or group holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub session_gpus: u32,
    pub job_gpus: u32,
    pub sessions: u32,
}

impl Held {
    fn add(&mut self, kind: Kind, gpus: u32) {
        match kind {
            Kind::Session => {
                self.session_gpus += gpus;
                self.sessions += 1;
            }
            Kind::Job => self.job_gpus += gpus,
        }
    }
}

/// GPUs held by work longer than the short class, in one length scope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LengthHeld {
    /// By work longer than `short` (medium and long).
    pub medium: u32,
    /// By work longer than `medium` (long, or without a class).
    pub long: u32,
}

/// One count of [`LengthHeld`]: a user's, a group's or the site's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LengthKey {
    User(Dn),
    Group(GroupName),
    Site,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Session,
    Job,
}

/// A request (waiting, or holding GPUs), as the limits see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<Id> {
    pub id: Id,
    pub owner: Dn,
    pub group: GroupName,
    pub kind: Kind,
    pub gpus: u32,
    /// The longest it may hold its GPUs: a job's max duration, a session's maximum lifetime;
    /// `None`: without end.
    pub length: Option<Duration>,
}

/// What every user, group and length scope holds: the work holding GPUs, and what a round
/// offered so far.
#[derive(Debug, Clone, Default)]
pub struct Holdings {
    by_user: HashMap<Dn, Held>,
    by_group: HashMap<GroupName, Held>,
    by_length: HashMap<LengthKey, LengthHeld>,
}

impl Holdings {
    /// Counts `work` as holding its GPUs.
    pub fn add<Id>(&mut self, work: &Request<Id>, config: &LimitsConfig) {
        self.by_user
            .entry(work.owner.clone())
            .or_default()
            .add(work.kind, work.gpus);
        self.by_group
            .entry(work.group.clone())
            .or_default()
            .add(work.kind, work.gpus);
        if let Some(classes) = &config.length_classes {
            let held = self.by_length.entry(length_key(classes, work)).or_default();
            match classes.class(work.length) {
                Some(LengthClass::Short) => {}
                Some(LengthClass::Medium) => held.medium += work.gpus,
                // Work without a class (the config changed since it started) counts as long.
                Some(LengthClass::Long) | None => {
                    held.medium += work.gpus;
                    held.long += work.gpus;
                }
            }
        }
    }

    pub fn user(&self, user: &Dn) -> Held {
        self.by_user.get(user).copied().unwrap_or_default()
    }

    pub fn group(&self, group: &GroupName) -> Held {
        self.by_group.get(group).copied().unwrap_or_default()
    }

    pub fn length(&self, key: &LengthKey) -> LengthHeld {
        self.by_length.get(key).copied().unwrap_or_default()
    }

    /// The first limit `request` would take past its maximum on a site of `site_gpus` GPUs.
    fn check<Id>(
        &self,
        request: &Request<Id>,
        config: &LimitsConfig,
        site_gpus: u32,
    ) -> Result<(), Blocked> {
        check(
            &config.user,
            &Scope::User,
            &self.user(&request.owner),
            request.kind,
            request.gpus,
        )?;
        check(
            &config.group_limit(&request.group),
            &Scope::Group(request.group.clone()),
            &self.group(&request.group),
            request.kind,
            request.gpus,
        )?;
        if let Some(classes) = &config.length_classes {
            let key = length_key(classes, request);
            check_length(classes, &key, self.length(&key), request, site_gpus)?;
        }
        Ok(())
    }
}

fn length_key<Id>(classes: &LengthClasses, work: &Request<Id>) -> LengthKey {
    match classes.per {
        LengthScope::User => LengthKey::User(work.owner.clone()),
        LengthScope::Group => LengthKey::Group(work.group.clone()),
        LengthScope::Site => LengthKey::Site,
    }
}

/// Whose limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    User,
    Group(GroupName),
    /// Everyone's work together (`[limits.length_classes] per = "site"`).
    Site,
}

/// The limit that holds a request back, or refuses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHit {
    pub scope: Scope,
    /// The config key: `max_gpus`, `max_session_gpus`, `max_job_gpus`, `max_sessions`, or the
    /// length classes' `medium_max_fraction` and `long_max_gpus`.
    pub key: &'static str,
    pub max: u32,
    /// What is held (and offered before it this round) in that count.
    pub held: u32,
    /// For a length class's limit: the length the counted work is longer than.
    pub longer_than: Option<Duration>,
}

impl LimitHit {
    /// The rule as the config states it: `limits.user max_gpus = 4`.
    pub fn rule(&self) -> String {
        if let Some(longer_than) = self.longer_than {
            let per = match &self.scope {
                Scope::User => "user".to_owned(),
                Scope::Group(group) => format!("group ({group})"),
                Scope::Site => "site".to_owned(),
            };
            return format!(
                "limits.length_classes {}: at most {} GPUs per {per} in work longer than {}",
                self.key,
                self.max,
                HumanDuration(longer_than)
            );
        }
        match &self.scope {
            Scope::User => format!("limits.user {} = {}", self.key, self.max),
            Scope::Group(group) => format!("limits, group {group}: {} = {}", self.key, self.max),
            Scope::Site => format!("limits {} = {}", self.key, self.max),
        }
    }
}

impl fmt::Display for LimitHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let whose = match &self.scope {
            Scope::User => "you hold".to_owned(),
            Scope::Group(group) => format!("group {group} holds"),
            Scope::Site => "the site's work holds".to_owned(),
        };
        if let Some(longer_than) = self.longer_than {
            return write!(
                f,
                "{whose} {} of at most {} GPUs in work longer than {} (limits.length_classes {})",
                self.held,
                self.max,
                HumanDuration(longer_than),
                self.key
            );
        }
        let section = match &self.scope {
            Scope::User => "limits.user".to_owned(),
            Scope::Group(group) => format!("limits, group {group}"),
            Scope::Site => "limits".to_owned(),
        };
        let what = match self.key {
            "max_sessions" => "sessions",
            "max_session_gpus" => "GPUs in sessions",
            "max_job_gpus" => "GPUs in jobs",
            _ => "GPUs",
        };
        write!(
            f,
            "{whose} {} of at most {} {what} ({section} {})",
            self.held, self.max, self.key
        )
    }
}

/// Why a request may not run now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blocked {
    /// It would take a count past its maximum.
    Limit(LimitHit),
    /// It may hold its GPUs longer than the longest length class (`length`; `None`: without
    /// end) takes: `longest`.
    TooLong {
        length: Option<Duration>,
        longest: Duration,
    },
}

impl Blocked {
    /// Why `request`, which could never run here, is refused, and what to ask for instead.
    pub fn refusal<Id>(&self, request: &Request<Id>) -> String {
        let what = match request.kind {
            Kind::Session => "session",
            Kind::Job => "job",
        };
        match self {
            Self::Limit(hit) => format!(
                "a {what} of {} GPUs can never run here: {}; ask for at most {}",
                request.gpus,
                hit.rule(),
                hit.max
            ),
            Self::TooLong { length, longest } => {
                let how_long = match length {
                    Some(length) => format!("of up to {}", HumanDuration(*length)),
                    None => "without a max duration".to_owned(),
                };
                format!(
                    "a {what} {how_long} can never run here: the longest work the site takes is \
                     {} (limits.length_classes long); ask for a max duration of at most that",
                    HumanDuration(*longest)
                )
            }
        }
    }
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Limit(hit) => hit.fmt(f),
            Self::TooLong { length, longest } => {
                match length {
                    Some(length) => write!(f, "it may hold GPUs for {}", HumanDuration(*length))?,
                    None => f.write_str("it has no max duration")?,
                }
                write!(
                    f,
                    ", longer than the longest work the site takes: {} (limits.length_classes \
                     long)",
                    HumanDuration(*longest)
                )
            }
        }
    }
}

/// The first of `limit`'s counts that `held` plus a `kind` request of `gpus` would exceed.
fn check(limit: &Limit, scope: &Scope, held: &Held, kind: Kind, gpus: u32) -> Result<(), Blocked> {
    let hit = |key, max: u32, held: u32| {
        Blocked::Limit(LimitHit {
            scope: scope.clone(),
            key,
            max,
            held,
            longer_than: None,
        })
    };
    let total = held.session_gpus + held.job_gpus;
    if let Some(max) = limit.max_gpus.filter(|&max| total + gpus > max) {
        return Err(hit("max_gpus", max, total));
    }
    match kind {
        Kind::Session => {
            if let Some(max) = limit
                .max_session_gpus
                .filter(|&max| held.session_gpus + gpus > max)
            {
                return Err(hit("max_session_gpus", max, held.session_gpus));
            }
            if let Some(max) = limit.max_sessions.filter(|&max| held.sessions + 1 > max) {
                return Err(hit("max_sessions", max, held.sessions));
            }
        }
        Kind::Job => {
            if let Some(max) = limit.max_job_gpus.filter(|&max| held.job_gpus + gpus > max) {
                return Err(hit("max_job_gpus", max, held.job_gpus));
            }
        }
    }
    Ok(())
}

/// Whether `request` fits its length class's maxima after `held` (in its scope `key`).
fn check_length<Id>(
    classes: &LengthClasses,
    key: &LengthKey,
    held: LengthHeld,
    request: &Request<Id>,
    site_gpus: u32,
) -> Result<(), Blocked> {
    let class = classes.class(request.length).ok_or(Blocked::TooLong {
        length: request.length,
        longest: classes.long,
    })?;
    let scope = match key {
        LengthKey::User(_) => Scope::User,
        LengthKey::Group(group) => Scope::Group(group.clone()),
        LengthKey::Site => Scope::Site,
    };
    let hit = |key, max, held, longer_than| {
        Blocked::Limit(LimitHit {
            scope: scope.clone(),
            key,
            max,
            held,
            longer_than: Some(longer_than),
        })
    };
    if class == LengthClass::Long && held.long + request.gpus > classes.long_max_gpus {
        return Err(hit(
            "long_max_gpus",
            classes.long_max_gpus,
            held.long,
            classes.medium,
        ));
    }
    let medium_max = classes.medium_max_gpus(site_gpus);
    if class >= LengthClass::Medium && held.medium + request.gpus > medium_max {
        return Err(hit(
            "medium_max_fraction",
            medium_max,
            held.medium,
            classes.short,
        ));
    }
    Ok(())
}

/// Which of `requests` (in the order they are served) the plan may place this round on a site
/// of `site_gpus` GPUs: each that fits its user's, its group's and its length class's limits
/// after what is `held` and what was offered before it. The others, with what holds them.
pub fn offer<Id: Clone>(
    requests: &[Request<Id>],
    held: &Holdings,
    config: &LimitsConfig,
    site_gpus: u32,
) -> Vec<(Id, Result<(), Blocked>)> {
    let mut holdings = held.clone();
    requests
        .iter()
        .map(|request| {
            let verdict = holdings.check(request, config, site_gpus);
            if verdict.is_ok() {
                holdings.add(request, config);
            }
            (request.id.clone(), verdict)
        })
        .collect()
}

/// What `request` exceeds even with nothing else held on a site of `site_gpus` GPUs, if
/// anything: it could never run here.
pub fn never_fits<Id>(
    request: &Request<Id>,
    config: &LimitsConfig,
    site_gpus: u32,
) -> Option<Blocked> {
    Holdings::default().check(request, config, site_gpus).err()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn dn(n: usize) -> Dn {
        Dn::parse(&format!("/DC=org/CN=User {n}")).unwrap()
    }

    fn group(n: usize) -> GroupName {
        GroupName::parse(&format!("g{n}")).unwrap()
    }

    fn request(
        id: usize,
        user: usize,
        kind: Kind,
        gpus: u32,
        length: Option<Duration>,
    ) -> Request<usize> {
        Request {
            id,
            owner: dn(user),
            // A user stays in one group; users 0 and 3 share group g0.
            group: group(user % 3),
            kind,
            gpus,
            length,
        }
    }

    fn config() -> LimitsConfig {
        LimitsConfig {
            user: Limit {
                max_gpus: Some(4),
                max_session_gpus: Some(2),
                max_job_gpus: None,
                max_sessions: Some(2),
            },
            group: Limit {
                max_gpus: Some(6),
                ..Limit::default()
            },
            groups: [(
                group(1),
                Limit {
                    max_gpus: Some(3),
                    ..Limit::default()
                },
            )]
            .into_iter()
            .collect(),
            length_classes: None,
        }
    }

    /// CHTC's classes and no other limit.
    fn classes_only(per: LengthScope) -> LimitsConfig {
        LimitsConfig {
            length_classes: Some(LengthClasses {
                per,
                ..LengthClasses::CHTC
            }),
            ..LimitsConfig::default()
        }
    }

    fn hit(verdict: &Result<(), Blocked>) -> LimitHit {
        match verdict {
            Err(Blocked::Limit(hit)) => hit.clone(),
            other => panic!("not held by a limit: {other:?}"),
        }
    }

    #[test]
    fn a_user_at_their_cap_waits_with_the_limit_named() {
        let config = config();
        let mut held = Holdings::default();
        held.add(&request(0, 0, Kind::Session, 2, None), &config);
        held.add(&request(0, 0, Kind::Job, 1, None), &config);
        let requests = [
            request(1, 0, Kind::Session, 1, None),
            request(2, 0, Kind::Job, 1, None),
            request(3, 0, Kind::Job, 1, None),
        ];
        let verdicts = offer(&requests, &held, &config, 8);
        assert_eq!(
            hit(&verdicts[0].1).to_string(),
            "you hold 2 of at most 2 GPUs in sessions (limits.user max_session_gpus)"
        );
        assert_eq!(verdicts[1].1, Ok(()));
        assert_eq!(
            hit(&verdicts[2].1).to_string(),
            "you hold 4 of at most 4 GPUs (limits.user max_gpus)"
        );
    }

    #[test]
    fn a_request_beyond_any_limit_is_refused_naming_it() {
        let refused = never_fits(&request(0, 0, Kind::Session, 3, None), &config(), 8).unwrap();
        assert_eq!(hit(&Err(refused)).key, "max_session_gpus");
        let four = request(0, 1, Kind::Job, 4, None);
        assert_eq!(
            never_fits(&four, &config(), 8).unwrap().refusal(&four),
            "a job of 4 GPUs can never run here: limits, group g1: max_gpus = 3; ask for at most 3"
        );
        assert_eq!(
            never_fits(&request(0, 0, Kind::Job, 4, None), &config(), 8),
            None
        );
    }

    #[test]
    fn classes_follow_the_declared_length_up_to_the_longest() {
        let classes = LengthClasses::CHTC;
        assert_eq!(classes.class(Some(HOUR)), Some(LengthClass::Short));
        assert_eq!(classes.class(Some(12 * HOUR)), Some(LengthClass::Short));
        assert_eq!(
            classes.class(Some(12 * HOUR + Duration::from_secs(1))),
            Some(LengthClass::Medium)
        );
        assert_eq!(classes.class(Some(24 * HOUR)), Some(LengthClass::Medium));
        assert_eq!(classes.class(Some(7 * 24 * HOUR)), Some(LengthClass::Long));
        assert_eq!(classes.class(Some(7 * 24 * HOUR + HOUR)), None);
        assert_eq!(classes.class(None), None);
        // A third of the site's GPUs, rounded down, at least one.
        assert_eq!(classes.medium_max_gpus(12), 4);
        assert_eq!(classes.medium_max_gpus(9), 3);
        assert_eq!(classes.medium_max_gpus(8), 2);
        assert_eq!(classes.medium_max_gpus(2), 1);
        assert_eq!(classes.medium_max_gpus(0), 1);
    }

    #[test]
    fn long_work_waits_at_its_cap_while_short_work_runs() {
        let config = classes_only(LengthScope::User);
        let mut held = Holdings::default();
        // User 0 holds 4 GPUs in a 3-day job: the long cap.
        held.add(&request(0, 0, Kind::Job, 4, Some(72 * HOUR)), &config);
        let requests = [
            request(1, 0, Kind::Job, 1, Some(48 * HOUR)),
            request(2, 0, Kind::Session, 2, Some(8 * HOUR)),
            request(3, 1, Kind::Job, 2, Some(7 * 24 * HOUR)),
            request(4, 0, Kind::Job, 1, Some(20 * HOUR)),
        ];
        let verdicts = offer(&requests, &held, &config, 24);
        assert_eq!(
            hit(&verdicts[0].1).to_string(),
            "you hold 4 of at most 4 GPUs in work longer than 1 day (limits.length_classes \
             long_max_gpus)"
        );
        assert_eq!(verdicts[1].1, Ok(()), "short work is never capped");
        assert_eq!(
            verdicts[2].1,
            Ok(()),
            "another user's long work has its own cap"
        );
        // Medium and long work together: at most a third of 24 GPUs, and user 0 holds 4 + 1.
        assert_eq!(verdicts[3].1, Ok(()));
        let medium = request(5, 0, Kind::Job, 5, Some(20 * HOUR));
        let verdicts = offer(&[medium], &held, &config, 24);
        assert_eq!(
            hit(&verdicts[0].1).to_string(),
            "you hold 4 of at most 8 GPUs in work longer than 12 hours (limits.length_classes \
             medium_max_fraction)"
        );
    }

    #[test]
    fn work_longer_than_the_longest_class_or_above_a_cap_is_refused_naming_it() {
        let config = classes_only(LengthScope::Site);
        let eight_days = request(0, 0, Kind::Job, 1, Some(8 * 24 * HOUR));
        assert_eq!(
            never_fits(&eight_days, &config, 8)
                .unwrap()
                .refusal(&eight_days),
            "a job of up to 1 week 1 day can never run here: the longest work the site takes is \
             1 week (limits.length_classes long); ask for a max duration of at most that"
        );
        let endless = request(0, 0, Kind::Job, 1, None);
        assert!(never_fits(&endless, &config, 8)
            .unwrap()
            .refusal(&endless)
            .starts_with("a job without a max duration can never run here"));
        let long = request(0, 0, Kind::Session, 5, Some(7 * 24 * HOUR));
        assert_eq!(
            never_fits(&long, &config, 100).unwrap().refusal(&long),
            "a session of 5 GPUs can never run here: limits.length_classes long_max_gpus: at \
             most 4 GPUs per site in work longer than 1 day; ask for at most 4"
        );
        let medium = request(0, 0, Kind::Job, 3, Some(24 * HOUR));
        assert_eq!(
            hit(&Err(never_fits(&medium, &config, 8).unwrap())).rule(),
            "limits.length_classes medium_max_fraction: at most 2 GPUs per site in work longer \
             than 12 hours"
        );
        assert_eq!(never_fits(&medium, &config, 9), None);
        assert_eq!(
            never_fits(&request(0, 0, Kind::Job, 50, Some(HOUR)), &config, 8),
            None
        );
    }

    fn lengths() -> impl Strategy<Value = Option<Duration>> {
        prop_oneof![
            Just(Some(HOUR)),
            Just(Some(12 * HOUR)),
            Just(Some(13 * HOUR)),
            Just(Some(24 * HOUR)),
            Just(Some(30 * HOUR)),
            Just(Some(7 * 24 * HOUR)),
            Just(Some(8 * 24 * HOUR)),
            Just(None),
        ]
    }

    fn scopes() -> impl Strategy<Value = LengthScope> {
        prop_oneof![
            Just(LengthScope::User),
            Just(LengthScope::Group),
            Just(LengthScope::Site),
        ]
    }

    proptest! {
        /// Whatever is held within the limits and whatever subset of the offered requests the
        /// plan places, no user's, group's or length scope's count goes over its limit.
        #[test]
        fn limits_are_never_exceeded(
            requests in proptest::collection::vec(
                (0usize..4, any::<bool>(), 1u32..4, lengths()), 0..30),
            placed_mask in any::<u64>(),
            with_classes in any::<bool>(),
            with_gpu_limits in any::<bool>(),
            per in scopes(),
            site_gpus in 0u32..40,
        ) {
            let mut config = if with_gpu_limits { config() } else { LimitsConfig::default() };
            if with_classes || !with_gpu_limits {
                config.length_classes = Some(LengthClasses { per, ..LengthClasses::CHTC });
            }
            let requests: Vec<Request<usize>> = requests
                .into_iter()
                .enumerate()
                .map(|(id, (user, session, gpus, length))| {
                    let kind = if session { Kind::Session } else { Kind::Job };
                    request(id, user, kind, gpus, length)
                })
                .collect();
            let verdicts = offer(&requests, &Holdings::default(), &config, site_gpus);
            let mut placed = Holdings::default();
            for (request, (_, verdict)) in requests.iter().zip(&verdicts) {
                if verdict.is_ok() && placed_mask & (1 << (request.id % 64)) != 0 {
                    placed.add(request, &config);
                }
            }
            let within = |limit: &Limit, held: &Held| {
                limit.max_gpus.is_none_or(|m| held.session_gpus + held.job_gpus <= m)
                    && limit.max_session_gpus.is_none_or(|m| held.session_gpus <= m)
                    && limit.max_job_gpus.is_none_or(|m| held.job_gpus <= m)
                    && limit.max_sessions.is_none_or(|m| held.sessions <= m)
            };
            for (user, held) in &placed.by_user {
                prop_assert!(within(&config.user, held), "{user} {held:?}");
            }
            for (name, held) in &placed.by_group {
                prop_assert!(within(&config.group_limit(name), held), "{name} {held:?}");
            }
            if let Some(classes) = &config.length_classes {
                for (key, held) in &placed.by_length {
                    prop_assert!(held.long <= classes.long_max_gpus, "{key:?} {held:?}");
                    prop_assert!(
                        held.medium <= classes.medium_max_gpus(site_gpus),
                        "{key:?} {held:?}"
                    );
                }
            }
            for (request, (_, verdict)) in requests.iter().zip(&verdicts) {
                match verdict {
                    // A request is held back only by a limit it would really exceed.
                    Err(Blocked::Limit(hit)) => {
                        let asked = if hit.key == "max_sessions" { 1 } else { request.gpus };
                        prop_assert!(hit.held + asked > hit.max, "{hit:?}");
                    }
                    // Only work no class takes is too long, and only with classes.
                    Err(Blocked::TooLong { .. }) => prop_assert!(
                        config.length_classes.is_some_and(|c| c.class(request.length).is_none())
                    ),
                    Ok(()) => prop_assert!(config
                        .length_classes
                        .is_none_or(|c| c.class(request.length).is_some())),
                }
            }
        }

        /// With only length classes set, short work is never held back, whatever medium and
        /// long work holds or asks for: it may use all open capacity.
        #[test]
        fn short_work_uses_all_open_capacity(
            held in proptest::collection::vec((0usize..4, 1u32..6, lengths()), 0..20),
            requests in proptest::collection::vec((0usize..4, 1u32..6, lengths()), 0..30),
            per in scopes(),
            site_gpus in 0u32..40,
        ) {
            let config = classes_only(per);
            let mut holdings = Holdings::default();
            for (user, gpus, length) in held {
                holdings.add(&request(0, user, Kind::Job, gpus, length), &config);
            }
            let requests: Vec<Request<usize>> = requests
                .into_iter()
                .enumerate()
                .map(|(id, (user, gpus, length))| request(id, user, Kind::Job, gpus, length))
                .collect();
            let verdicts = offer(&requests, &holdings, &config, site_gpus);
            for (request, (_, verdict)) in requests.iter().zip(&verdicts) {
                if request.length.is_some_and(|l| l <= LengthClasses::CHTC.short) {
                    prop_assert_eq!(verdict, &Ok(()));
                }
            }
        }
    }
}
