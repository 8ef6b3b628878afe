//! Limits per user and per accounting group: most GPUs held at once by sessions, by jobs, and
//! by both together, and most sessions holding GPUs at once (`[limits]`).
//!
//! Each scheduling round, the waiting requests are taken in the order the scheduler serves them;
//! one is offered to the plan only when its GPUs fit every applicable limit's headroom after
//! what is held and what was offered before it, so whatever subset the plan places, no limit is
//! ever exceeded. The others wait with the limit named ([`LimitHit`]). A request larger than a
//! limit could ever allow is refused when it is made ([`never_fits`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use ongrid_core::Dn;

use super::GroupName;

/// The maxima of one user or one group; `None`: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    /// GPUs held by sessions and jobs together.
    pub max_gpus: Option<u32>,
    pub max_session_gpus: Option<u32>,
    pub max_job_gpus: Option<u32>,
    /// Sessions holding GPUs (running, starting or waiting for a connection).
    pub max_sessions: Option<u32>,
}

/// The validated `[limits]` section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitsConfig {
    /// Every user's.
    pub user: Limit,
    /// Every group's, unless `groups` names it.
    pub group: Limit,
    pub groups: BTreeMap<GroupName, Limit>,
}

impl LimitsConfig {
    fn group_limit(&self, group: &GroupName) -> Limit {
        self.groups.get(group).copied().unwrap_or(self.group)
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Session,
    Job,
}

/// A waiting request, as the limits see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<Id> {
    pub id: Id,
    pub owner: Dn,
    pub group: GroupName,
    pub kind: Kind,
    pub gpus: u32,
}

/// Whose limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    User,
    Group(GroupName),
}

/// The limit that holds a request back, or refuses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHit {
    pub scope: Scope,
    /// The config key: `max_gpus`, `max_session_gpus`, `max_job_gpus`, `max_sessions`.
    pub key: &'static str,
    pub max: u32,
    /// What is held (and offered before it this round) in that count.
    pub held: u32,
}

impl LimitHit {
    /// The rule as the config states it: `limits.user max_gpus = 4`.
    pub fn rule(&self) -> String {
        match &self.scope {
            Scope::User => format!("limits.user {} = {}", self.key, self.max),
            Scope::Group(group) => format!("limits, group {group}: {} = {}", self.key, self.max),
        }
    }
}

impl fmt::Display for LimitHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whose, section) = match &self.scope {
            Scope::User => ("you hold".to_owned(), "limits.user".to_owned()),
            Scope::Group(group) => (
                format!("group {group} holds"),
                format!("limits, group {group}"),
            ),
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

/// The first of `limit`'s counts that `held` plus a `kind` request of `gpus` would exceed.
fn check(limit: &Limit, scope: &Scope, held: &Held, kind: Kind, gpus: u32) -> Result<(), LimitHit> {
    let hit = |key, max: u32, held: u32| LimitHit {
        scope: scope.clone(),
        key,
        max,
        held,
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

/// Which of `requests` (in the order they are served) the plan may place this round: each whose
/// GPUs fit its user's and its group's limits after what they hold (`by_user`, `by_group`) and
/// what was offered before it. The others, with the limit that holds them.
pub fn offer<Id: Clone>(
    requests: &[Request<Id>],
    by_user: &HashMap<Dn, Held>,
    by_group: &HashMap<GroupName, Held>,
    config: &LimitsConfig,
) -> Vec<(Id, Result<(), LimitHit>)> {
    let mut users = by_user.clone();
    let mut groups = by_group.clone();
    requests
        .iter()
        .map(|request| {
            let user = users.entry(request.owner.clone()).or_default();
            let verdict = check(&config.user, &Scope::User, user, request.kind, request.gpus)
                .and_then(|()| {
                    let group = groups.get(&request.group).copied().unwrap_or_default();
                    check(
                        &config.group_limit(&request.group),
                        &Scope::Group(request.group.clone()),
                        &group,
                        request.kind,
                        request.gpus,
                    )
                });
            if verdict.is_ok() {
                user.add(request.kind, request.gpus);
                groups
                    .entry(request.group.clone())
                    .or_default()
                    .add(request.kind, request.gpus);
            }
            (request.id.clone(), verdict)
        })
        .collect()
}

/// The limit a `kind` request of `gpus` by a member of `group` exceeds even with nothing else
/// held, if any: it could never run here.
pub fn never_fits(
    kind: Kind,
    gpus: u32,
    group: &GroupName,
    config: &LimitsConfig,
) -> Option<LimitHit> {
    check(&config.user, &Scope::User, &Held::default(), kind, gpus)
        .and_then(|()| {
            check(
                &config.group_limit(group),
                &Scope::Group(group.clone()),
                &Held::default(),
                kind,
                gpus,
            )
        })
        .err()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn dn(n: usize) -> Dn {
        Dn::parse(&format!("/DC=org/CN=User {n}")).unwrap()
    }

    fn group(n: usize) -> GroupName {
        GroupName::parse(&format!("g{n}")).unwrap()
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
        }
    }

    #[test]
    fn a_user_at_their_cap_waits_with_the_limit_named() {
        let held: HashMap<Dn, Held> = [(
            dn(0),
            Held {
                session_gpus: 2,
                job_gpus: 1,
                sessions: 1,
            },
        )]
        .into_iter()
        .collect();
        let requests = [
            Request {
                id: 1,
                owner: dn(0),
                group: group(0),
                kind: Kind::Session,
                gpus: 1,
            },
            Request {
                id: 2,
                owner: dn(0),
                group: group(0),
                kind: Kind::Job,
                gpus: 1,
            },
            Request {
                id: 3,
                owner: dn(0),
                group: group(0),
                kind: Kind::Job,
                gpus: 1,
            },
        ];
        let verdicts = offer(&requests, &held, &HashMap::new(), &config());
        let hit = verdicts[0].1.clone().unwrap_err();
        assert_eq!(
            hit.to_string(),
            "you hold 2 of at most 2 GPUs in sessions (limits.user max_session_gpus)"
        );
        assert_eq!(verdicts[1].1, Ok(()));
        let hit = verdicts[2].1.clone().unwrap_err();
        assert_eq!(
            hit.to_string(),
            "you hold 4 of at most 4 GPUs (limits.user max_gpus)"
        );
    }

    #[test]
    fn a_request_beyond_any_limit_is_refused_naming_it() {
        let hit = never_fits(Kind::Session, 3, &group(0), &config()).unwrap();
        assert_eq!(hit.key, "max_session_gpus");
        assert_eq!(
            never_fits(Kind::Job, 4, &group(1), &config())
                .unwrap()
                .rule(),
            "limits, group g1: max_gpus = 3"
        );
        assert_eq!(never_fits(Kind::Job, 4, &group(0), &config()), None);
    }

    proptest! {
        /// Whatever is held within the limits and whatever subset of the offered requests the
        /// plan places, no user's or group's count goes over its limit.
        #[test]
        fn limits_are_never_exceeded(
            requests in proptest::collection::vec((0usize..4, any::<bool>(), 1u32..4), 0..30),
            placed_mask in any::<u64>(),
        ) {
            let config = config();
            let requests: Vec<Request<usize>> = requests
                .into_iter()
                .enumerate()
                .map(|(id, (user, session, gpus))| Request {
                    id,
                    owner: dn(user),
                    // A user stays in one group; users 0 and 3 share group g0.
                    group: group(user % 3),
                    kind: if session { Kind::Session } else { Kind::Job },
                    gpus,
                })
                .collect();
            let verdicts = offer(&requests, &HashMap::new(), &HashMap::new(), &config);
            let mut users: HashMap<Dn, Held> = HashMap::new();
            let mut groups: HashMap<GroupName, Held> = HashMap::new();
            for (request, (_, verdict)) in requests.iter().zip(&verdicts) {
                if verdict.is_ok() && placed_mask & (1 << (request.id % 64)) != 0 {
                    users.entry(request.owner.clone()).or_default().add(request.kind, request.gpus);
                    groups.entry(request.group.clone()).or_default().add(request.kind, request.gpus);
                }
            }
            let within = |limit: &Limit, held: &Held| {
                limit.max_gpus.is_none_or(|m| held.session_gpus + held.job_gpus <= m)
                    && limit.max_session_gpus.is_none_or(|m| held.session_gpus <= m)
                    && limit.max_job_gpus.is_none_or(|m| held.job_gpus <= m)
                    && limit.max_sessions.is_none_or(|m| held.sessions <= m)
            };
            for held in users.values() {
                prop_assert!(within(&config.user, held), "{held:?}");
            }
            for (name, held) in &groups {
                prop_assert!(within(&config.group_limit(name), held), "{name} {held:?}");
            }
            // A request is held back only by a limit it would really exceed.
            for (request, (_, verdict)) in requests.iter().zip(&verdicts) {
                if let Err(hit) = verdict {
                    let asked = if hit.key == "max_sessions" { 1 } else { request.gpus };
                    prop_assert!(hit.held + asked > hit.max, "{hit:?}");
                }
            }
        }
    }
}
