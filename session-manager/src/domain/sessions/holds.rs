//! The hold policy: when a running session is put on HOLD (its container stopped, its GPUs
//! freed, its files kept), its deadlines, and what keeps it alive.
//!
//! The policy is a pure function of a session's stored [`LifecycleFacts`] (absolute times, see
//! `migrations/0004_lifecycle.sql`), the site's [`LifecycleConfig`] and `now`:
//!
//! - **no-connection**: a WAITING session (nobody connected since it became ready, after its
//!   start or its release) is held `connect_deadline` after it became ready — never before the
//!   start-up grace ends, nor before an explicit keep-alive ends.
//! - **idle**: a session is held `idle_timeout` after its last activity, connections open or
//!   not: the close of a connection, SSH data the client sent (keystrokes, uploads, forwarded
//!   ports' data; SSH keep-alives are not channel data and never count), a CPU or GPU sample at
//!   or above the site's threshold, or becoming ready. Never before the start-up grace
//!   (`startup_grace` after becoming ready) or a keep-alive (`devctl session keep`) ends. A
//!   forgotten terminal or editor window therefore no longer holds GPUs until the maximum
//!   lifetime. A site that wants an open connection to keep its session alive sets
//!   `[lifecycle] open_connection_keeps_alive = true`: then a live connection (reported by the
//!   gateway within `connection_stale_after`) keeps the session, and the idle countdown starts
//!   when the last one closes or goes stale.
//! - **max-duration**: a session is held `max_duration` of wall time after it first started,
//!   HELD time included.
//!
//! Only running sessions (WAITING, CONNECTED, IDLE) are held by the policy. [`due_hold`] is the
//! decision the hold timer (`crate::hold_timer`) stores; an overdue hold (after a manager
//! restart) is applied at the current time, its reason saying when it was due.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::holds::{
    ActivitySignal, HoldReason, LifecycleView, PlannedHold, SessionDeadlines, SignalKind,
};
use ongrid_core::{HumanDuration, SessionId, SessionState};

use super::Change;
use crate::domain::utc;

/// The longest duration the policy computes with (about 100 years): `[lifecycle]` refuses longer
/// ones, which would overflow the deadlines.
pub const LONGEST: Duration = Duration::from_secs(5200 * 604_800);

/// A hold applied later than this after it was due says so in its reason.
const LATE: TimeDelta = TimeDelta::seconds(5);

/// The validated `[lifecycle]` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LifecycleConfig {
    pub connect_deadline: Duration,
    /// The site's default idle timeout.
    pub idle_timeout: Duration,
    /// The most a session may ask for.
    pub max_idle_timeout: Duration,
    /// The site's default maximum lifetime.
    pub max_duration: Duration,
    /// The most a session may ask for.
    pub max_max_duration: Duration,
    pub startup_grace: Duration,
    /// The longest keep-alive one `devctl session keep` gives.
    pub keep_max: Duration,
    /// How long before a hold the gateway warns connected terminals (it reads the deadlines).
    pub warn_before: Duration,
    pub thresholds: ActivityThresholds,
    pub connection_stale_after: Duration,
    /// An open connection alone keeps a session alive (the behaviour before honest idleness).
    pub open_connection_keeps_alive: bool,
}

impl Default for LifecycleConfig {
    /// The values of [`RawLifecycle::default`] (a test checks they agree).
    fn default() -> Self {
        Self {
            connect_deadline: Duration::from_secs(20 * 60),
            idle_timeout: Duration::from_secs(2 * 3600),
            max_idle_timeout: Duration::from_secs(8 * 3600),
            max_duration: Duration::from_secs(7 * 86_400),
            max_max_duration: Duration::from_secs(14 * 86_400),
            startup_grace: Duration::from_secs(5 * 60),
            keep_max: Duration::from_secs(12 * 3600),
            warn_before: Duration::from_secs(10 * 60),
            thresholds: ActivityThresholds {
                cpu_percent: 5.0,
                gpu_percent: 5.0,
            },
            connection_stale_after: Duration::from_secs(3 * 60),
            open_connection_keeps_alive: false,
        }
    }
}

/// Samples at or above these count as activity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivityThresholds {
    /// Percent of one core (200 = two busy cores).
    pub cpu_percent: f64,
    pub gpu_percent: f64,
}

impl LifecycleConfig {
    /// The idle timeout and maximum lifetime a new session gets: its own request within the
    /// site's maxima, else the site's defaults. The error says what is allowed.
    pub fn limits_for(
        &self,
        idle_timeout_secs: Option<u64>,
        max_duration_secs: Option<u64>,
    ) -> Result<(u64, u64), String> {
        let check = |asked: Option<u64>, default: Duration, max: Duration, flag: &str| {
            let Some(asked) = asked else {
                return Ok(default.as_secs());
            };
            if asked == 0 {
                return Err(format!("{flag} must be longer than 0 seconds"));
            }
            if asked > max.as_secs() {
                return Err(format!(
                    "{flag} {} is more than this site allows ({}): ask for {} or less",
                    HumanDuration(Duration::from_secs(asked)),
                    HumanDuration(max),
                    HumanDuration(max)
                ));
            }
            Ok(asked)
        };
        Ok((
            check(
                idle_timeout_secs,
                self.idle_timeout,
                self.max_idle_timeout,
                "--idle-timeout",
            )?,
            check(
                max_duration_secs,
                self.max_duration,
                self.max_max_duration,
                "--max-duration",
            )?,
        ))
    }
}

/// One activity measure as stored: the last sample at or above the threshold, and the last
/// sample whatever its value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sampled {
    pub active_at: Option<DateTime<Utc>>,
    pub sampled_at: Option<DateTime<Utc>>,
    pub percent: Option<f64>,
}

/// Everything the policy knows about one session; every time is absolute (the manager's clock).
#[derive(Debug, Clone, PartialEq)]
pub struct LifecycleFacts {
    pub session_id: SessionId,
    pub state: SessionState,
    /// When it entered its current state.
    pub state_since: DateTime<Utc>,
    /// Its own values; `None`: the site's default.
    pub idle_timeout_secs: Option<u64>,
    pub max_duration_secs: Option<u64>,
    /// When its container first ran.
    pub first_started_at: Option<DateTime<Utc>>,
    /// When it last became ready (WAITING), after a start or a release.
    pub ready_at: Option<DateTime<Utc>>,
    pub last_close_at: Option<DateTime<Utc>>,
    pub last_traffic_at: Option<DateTime<Utc>>,
    pub cpu: Sampled,
    pub gpu: Sampled,
    pub keep_until: Option<DateTime<Utc>>,
    /// The last report (open or periodic activity) of each connection still open, oldest first.
    pub open_connections: Vec<DateTime<Utc>>,
}

/// A hold the policy plans, with the words it will be stored with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub hold: PlannedHold,
    /// What the reason of the hold (`hold.reason`) is based on, in words for people.
    pub details: String,
    /// The signal that set this deadline, when it is activity that keeps the session alive.
    pub kept_alive_by: Option<SignalKind>,
}

/// What the policy says about one session at one time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    /// The earliest hold (due when `at <= now`), if any applies.
    pub next: Option<Planned>,
    /// What keeps it alive now, if anything.
    pub kept_alive_by: Option<SignalKind>,
    /// For a session the idle rule applies to: its last activity (or when it became ready).
    pub last_activity: Option<DateTime<Utc>>,
}

fn delta(duration: Duration) -> TimeDelta {
    TimeDelta::from_std(duration).unwrap_or(TimeDelta::MAX)
}

fn secs(value: u64) -> TimeDelta {
    TimeDelta::try_seconds(i64::try_from(value).unwrap_or(i64::MAX)).unwrap_or(TimeDelta::MAX)
}

fn human(d: TimeDelta) -> HumanDuration {
    HumanDuration(d.to_std().unwrap_or_default())
}

impl LifecycleFacts {
    pub fn idle_timeout(&self, config: &LifecycleConfig) -> TimeDelta {
        self.idle_timeout_secs
            .map(secs)
            .unwrap_or_else(|| delta(config.idle_timeout))
    }

    pub fn max_duration(&self, config: &LifecycleConfig) -> TimeDelta {
        self.max_duration_secs
            .map(secs)
            .unwrap_or_else(|| delta(config.max_duration))
    }

    /// When the maximum lifetime ends: `max_duration` after the first start.
    pub fn max_end_at(&self, config: &LifecycleConfig) -> Option<DateTime<Utc>> {
        self.first_started_at
            .and_then(|t| t.checked_add_signed(self.max_duration(config)))
    }

    /// Open connections the gateway reported within `connection_stale_after`.
    pub fn live_connections(&self, config: &LifecycleConfig, now: DateTime<Utc>) -> usize {
        let cutoff = now - delta(config.connection_stale_after);
        self.open_connections
            .iter()
            .filter(|&&at| at >= cutoff)
            .count()
    }

    fn ready(&self) -> DateTime<Utc> {
        self.ready_at.unwrap_or(self.state_since)
    }

    /// The last sign of use of the connection signal: a close, or the last report of a
    /// connection that went stale.
    fn last_connection(&self) -> Option<DateTime<Utc>> {
        self.open_connections
            .iter()
            .copied()
            .chain(self.last_close_at)
            .max()
    }
}

/// The policy: the earliest hold that applies to the session, and what keeps it alive.
pub fn evaluate(
    facts: &LifecycleFacts,
    config: &LifecycleConfig,
    now: DateTime<Utc>,
) -> Evaluation {
    let running = matches!(
        facts.state,
        SessionState::Waiting | SessionState::Connected | SessionState::Idle
    );
    if !running {
        return Evaluation {
            next: None,
            kept_alive_by: None,
            last_activity: None,
        };
    }
    let mut candidates: Vec<Planned> = max_duration_hold(facts, config).into_iter().collect();
    let live = facts.live_connections(config, now);
    let mut last_activity = None;
    let kept_alive_by = if live > 0 && config.open_connection_keeps_alive {
        Some(SignalKind::Connection)
    } else {
        let planned = if facts.state == SessionState::Waiting && live == 0 {
            no_connection_hold(facts, config)
        } else {
            let (planned, last) = idle_hold(facts, config, live);
            last_activity = Some(last);
            planned
        };
        let by = planned.kept_alive_by.filter(|_| planned.hold.at > now);
        candidates.push(planned);
        by
    };
    let next = candidates.into_iter().min_by_key(|p| p.hold.at);
    Evaluation {
        next,
        kept_alive_by,
        last_activity,
    }
}

/// The hold at the end of the session's maximum lifetime, once it has started.
fn max_duration_hold(facts: &LifecycleFacts, config: &LifecycleConfig) -> Option<Planned> {
    let (end, first) = (facts.max_end_at(config)?, facts.first_started_at?);
    Some(Planned {
        hold: PlannedHold {
            at: end,
            reason: HoldReason::MaxDuration,
        },
        details: format!(
            "the session reached its maximum lifetime of {} (first started at {})",
            human(facts.max_duration(config)),
            utc(first)
        ),
        kept_alive_by: None,
    })
}

/// The end of the startup grace, and a keep-alive the owner asked for after the session
/// became ready.
fn grace_and_keep(
    facts: &LifecycleFacts,
    config: &LifecycleConfig,
) -> (DateTime<Utc>, Option<DateTime<Utc>>) {
    let ready = facts.ready();
    let keep = facts.keep_until.filter(|&k| k > ready);
    (ready + delta(config.startup_grace), keep)
}

/// The hold of a session nobody connected to within the connect deadline (not before the
/// startup grace ends, nor before a keep-alive does).
fn no_connection_hold(facts: &LifecycleFacts, config: &LifecycleConfig) -> Planned {
    let ready = facts.ready();
    let (grace_end, keep) = grace_and_keep(facts, config);
    let mut at = (ready + delta(config.connect_deadline)).max(grace_end);
    let mut by = None;
    if let Some(keep) = keep.filter(|&k| k > at) {
        at = keep;
        by = Some(SignalKind::Keep);
    }
    Planned {
        hold: PlannedHold {
            at,
            reason: HoldReason::NoConnection,
        },
        details: format!(
            "nobody connected within {} of the session becoming ready at {}",
            HumanDuration(config.connect_deadline),
            utc(ready)
        ),
        kept_alive_by: by,
    }
}

/// The idle hold: the idle timeout after the last sign of use (not before the startup grace
/// ends, nor before a keep-alive does); and when that last sign was.
fn idle_hold(
    facts: &LifecycleFacts,
    config: &LifecycleConfig,
    live: usize,
) -> (Planned, DateTime<Utc>) {
    let idle = facts.idle_timeout(config);
    let (grace_end, keep) = grace_and_keep(facts, config);
    // An open connection is no activity of its own (unless the site says so): only its
    // close, and what the client sends, count.
    let connection = if config.open_connection_keeps_alive {
        facts.last_connection()
    } else {
        facts.last_close_at
    };
    let signals = [
        (SignalKind::Connection, connection),
        (SignalKind::SshTraffic, facts.last_traffic_at),
        (SignalKind::Cpu, facts.cpu.active_at),
        (SignalKind::Gpu, facts.gpu.active_at),
    ];
    let mut last = facts.ready();
    let mut by = None;
    for (kind, seen) in signals {
        if let Some(seen) = seen.filter(|&s| s > last) {
            last = seen;
            by = Some(kind);
        }
    }
    let mut at = last + idle;
    if grace_end > at {
        at = grace_end;
        by = None;
    }
    if let Some(keep) = keep.filter(|&k| k > at) {
        at = keep;
        by = Some(SignalKind::Keep);
    }
    let since = match by {
        Some(SignalKind::Keep) => format!("the keep-alive ended at {}", utc(at)),
        _ => format!("last activity at {}", utc(last)),
    };
    let (cpu, gpu) = (config.thresholds.cpu_percent, config.thresholds.gpu_percent);
    let details = if live > 0 {
        format!(
            "connected but no activity (SSH input, CPU at or above {cpu}%, GPU at or above \
             {gpu}%) for {}; {since}",
            human(idle)
        )
    } else {
        format!(
            "no SSH connection and no activity (SSH traffic, CPU at or above {cpu}%, GPU at \
             or above {gpu}%) for {}; {since}",
            human(idle)
        )
    };
    let planned = Planned {
        hold: PlannedHold {
            at,
            reason: HoldReason::Idle,
        },
        details,
        kept_alive_by: by,
    };
    (planned, last)
}

/// The hold due at `now`, if any: the change that holds the session, and why.
pub fn due_hold(
    facts: &LifecycleFacts,
    config: &LifecycleConfig,
    now: DateTime<Utc>,
) -> Option<(Change, HoldReason)> {
    let planned = evaluate(facts, config, now)
        .next
        .filter(|planned| planned.hold.at <= now)?;
    let change = Change::hold(planned.hold.reason, now, hold_details(&planned, now));
    Some((change, planned.hold.reason))
}

impl Planned {
    /// The reason of the hold as people read it: `idle: no SSH connection ...`.
    pub fn sentence(&self) -> String {
        self.hold.reason.sentence(&self.details)
    }
}

/// The details a due hold is stored with: the policy's words, and when it was due if that was
/// a while ago (for example while the manager was not running).
pub fn hold_details(planned: &Planned, now: DateTime<Utc>) -> String {
    if now - planned.hold.at > LATE {
        format!("{} (due at {})", planned.details, utc(planned.hold.at))
    } else {
        planned.details.clone()
    }
}

/// The deadlines of a session, for the gateway and `devctl session show`.
pub fn deadlines(
    facts: &LifecycleFacts,
    config: &LifecycleConfig,
    now: DateTime<Utc>,
) -> SessionDeadlines {
    let evaluation = evaluate(facts, config, now);
    SessionDeadlines {
        session_id: facts.session_id,
        state: facts.state,
        idle_timeout_secs: facts
            .idle_timeout(config)
            .num_seconds()
            .max(0)
            .unsigned_abs(),
        max_end_at: facts.max_end_at(config),
        keep_until: facts.keep_until.filter(|&k| k > now),
        next_hold: evaluation.next.map(|p| p.hold),
    }
}

/// The lifecycle part of a session's view: deadlines, every signal as last seen, and what keeps
/// it alive — the answer to "why is this session still alive?".
pub fn view(facts: &LifecycleFacts, config: &LifecycleConfig, now: DateTime<Utc>) -> LifecycleView {
    let evaluation = evaluate(facts, config, now);
    let live = facts.live_connections(config, now);
    let stale = facts.open_connections.len() - live;
    let connection_detail = match (live, stale) {
        (0, 0) => "none open".to_owned(),
        (n, 0) => format!("{n} open"),
        (n, s) => format!(
            "{n} open, {s} not reported for over {}",
            HumanDuration(config.connection_stale_after)
        ),
    };
    let sample = |s: &Sampled, unit: &str, threshold: f64| match (s.percent, s.sampled_at) {
        (Some(p), Some(at)) => Some(format!(
            "last sample {p:.0}% {unit} at {} (threshold {threshold}%)",
            utc(at)
        )),
        _ => Some("no samples yet".to_owned()),
    };
    let signals = vec![
        ActivitySignal {
            kind: SignalKind::Connection,
            last_seen: if live > 0 {
                Some(now)
            } else {
                facts.last_connection()
            },
            detail: Some(connection_detail),
        },
        ActivitySignal {
            kind: SignalKind::SshTraffic,
            last_seen: facts.last_traffic_at,
            detail: None,
        },
        ActivitySignal {
            kind: SignalKind::Cpu,
            last_seen: facts.cpu.active_at,
            detail: sample(&facts.cpu, "CPU", config.thresholds.cpu_percent),
        },
        ActivitySignal {
            kind: SignalKind::Gpu,
            last_seen: facts.gpu.active_at,
            detail: sample(&facts.gpu, "GPU", config.thresholds.gpu_percent),
        },
        ActivitySignal {
            kind: SignalKind::Keep,
            last_seen: facts.keep_until,
            detail: facts.keep_until.map(|k| {
                if k > now {
                    format!("kept alive until {}", utc(k))
                } else {
                    format!("keep-alive ended at {}", utc(k))
                }
            }),
        },
    ];
    LifecycleView {
        deadlines: deadlines(facts, config, now),
        signals,
        kept_alive_by: evaluation.kept_alive_by,
        connected_idle_since: connected_idle_since(facts, config, &evaluation, now),
    }
}

/// Longest quiet spell before `session show` calls a connected session idle (shorter when the
/// idle timeout is short: a quarter of it).
const IDLE_NOTICE: TimeDelta = TimeDelta::minutes(5);

/// When a connected session's last activity was, if nothing was seen for a while (a quarter of
/// its idle timeout, at most [`IDLE_NOTICE`]): `session show` says "connected but idle since".
fn connected_idle_since(
    facts: &LifecycleFacts,
    config: &LifecycleConfig,
    evaluation: &Evaluation,
    now: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    if facts.live_connections(config, now) == 0
        || evaluation.kept_alive_by == Some(SignalKind::Keep)
    {
        return None;
    }
    let last = evaluation.last_activity?;
    let notice = (facts.idle_timeout(config) / 4).min(IDLE_NOTICE);
    (now - last >= notice).then_some(last)
}

/// The new end of a keep-alive asked for `asked` at `now`: at most `keep_max` from now.
pub fn keep_until(config: &LifecycleConfig, asked: Duration, now: DateTime<Utc>) -> DateTime<Utc> {
    now + delta(asked.min(config.keep_max))
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000, 0).unwrap()
    }

    fn at(secs: i64) -> DateTime<Utc> {
        t0() + TimeDelta::seconds(secs)
    }

    fn config() -> LifecycleConfig {
        LifecycleConfig {
            connect_deadline: Duration::from_secs(1200),
            idle_timeout: Duration::from_secs(7200),
            max_idle_timeout: Duration::from_secs(8 * 3600),
            max_duration: Duration::from_secs(7 * 86_400),
            max_max_duration: Duration::from_secs(14 * 86_400),
            startup_grace: Duration::from_secs(300),
            keep_max: Duration::from_secs(12 * 3600),
            warn_before: Duration::from_secs(600),
            thresholds: ActivityThresholds {
                cpu_percent: 5.0,
                gpu_percent: 5.0,
            },
            connection_stale_after: Duration::from_secs(180),
            open_connection_keeps_alive: false,
        }
    }

    /// A session that became ready (first start) at t0, WAITING since.
    fn waiting() -> LifecycleFacts {
        LifecycleFacts {
            session_id: SessionId::new_random(),
            state: SessionState::Waiting,
            state_since: t0(),
            idle_timeout_secs: None,
            max_duration_secs: None,
            first_started_at: Some(t0()),
            ready_at: Some(t0()),
            last_close_at: None,
            last_traffic_at: None,
            cpu: Sampled::default(),
            gpu: Sampled::default(),
            keep_until: None,
            open_connections: Vec::new(),
        }
    }

    /// Connected at +60 s, disconnected at `closed`: IDLE since.
    fn idle_since(closed: i64) -> LifecycleFacts {
        LifecycleFacts {
            state: SessionState::Idle,
            state_since: at(closed),
            last_close_at: Some(at(closed)),
            ..waiting()
        }
    }

    fn next(facts: &LifecycleFacts, now: DateTime<Utc>) -> Option<(DateTime<Utc>, HoldReason)> {
        evaluate(facts, &config(), now)
            .next
            .map(|p| (p.hold.at, p.hold.reason))
    }

    #[test]
    fn a_session_nobody_connects_to_is_held_at_the_connect_deadline() {
        let facts = waiting();
        assert_eq!(
            next(&facts, at(0)),
            Some((at(1200), HoldReason::NoConnection))
        );
        let planned = evaluate(&facts, &config(), at(1200)).next.unwrap();
        assert_eq!(
            planned.sentence(),
            "no-connection: nobody connected within 20 minutes of the session becoming ready \
             at 2023-11-14 22:13:20 UTC"
        );
        // CPU use of a session nobody connected to does not keep it.
        let busy = LifecycleFacts {
            cpu: Sampled {
                active_at: Some(at(1100)),
                sampled_at: Some(at(1100)),
                percent: Some(90.0),
            },
            ..waiting()
        };
        assert_eq!(
            next(&busy, at(1100)),
            Some((at(1200), HoldReason::NoConnection))
        );
    }

    #[test]
    fn a_release_restarts_the_connect_deadline() {
        let released = LifecycleFacts {
            ready_at: Some(at(86_400)),
            state_since: at(86_400),
            ..waiting()
        };
        assert_eq!(
            next(&released, at(86_400)),
            Some((at(86_400 + 1200), HoldReason::NoConnection))
        );
    }

    #[test]
    fn the_start_up_grace_is_a_floor() {
        let mut short = config();
        short.connect_deadline = Duration::from_secs(60);
        let facts = waiting();
        let planned = evaluate(&facts, &short, at(0)).next.unwrap();
        assert_eq!(planned.hold.at, at(300));
        // Idle too: disconnected at +10 s with a 60 s idle timeout, held at the grace's end.
        let idle = LifecycleFacts {
            idle_timeout_secs: Some(60),
            ..idle_since(10)
        };
        assert_eq!(next(&idle, at(10)), Some((at(300), HoldReason::Idle)));
        let evaluation = evaluate(&idle, &config(), at(10));
        assert_eq!(evaluation.kept_alive_by, None, "the grace is no signal");
        // After the grace, the idle timeout counts from the last activity.
        let later = LifecycleFacts {
            idle_timeout_secs: Some(60),
            ..idle_since(400)
        };
        assert_eq!(next(&later, at(400)), Some((at(460), HoldReason::Idle)));
    }

    #[test]
    fn an_open_connection_alone_does_not_keep_a_session_alive() {
        // Connected, and nothing since it became ready at 0: the gateway reports the connection
        // every minute, but only activity counts. Held as idle 2 hours after it became ready.
        let connected = LifecycleFacts {
            state: SessionState::Connected,
            open_connections: vec![at(7100)],
            ..waiting()
        };
        let evaluation = evaluate(&connected, &config(), at(7100));
        assert_eq!(evaluation.kept_alive_by, None);
        let planned = evaluation.next.unwrap();
        assert_eq!(
            (planned.hold.at, planned.hold.reason),
            (at(7200), HoldReason::Idle)
        );
        assert!(
            planned
                .details
                .starts_with("connected but no activity (SSH input, CPU at or above 5%"),
            "{}",
            planned.details
        );
        let shown = view(&connected, &config(), at(7100));
        assert_eq!(shown.connected_idle_since, Some(at(0)));
        // Typing at 6000 defers it, and the session is not called idle 60 s later.
        let typing = LifecycleFacts {
            last_traffic_at: Some(at(6000)),
            ..connected.clone()
        };
        assert_eq!(
            next(&typing, at(6060)),
            Some((at(13_200), HoldReason::Idle))
        );
        assert_eq!(
            evaluate(&typing, &config(), at(6060)).kept_alive_by,
            Some(SignalKind::SshTraffic)
        );
        assert_eq!(
            view(&typing, &config(), at(6060)).connected_idle_since,
            None
        );
        // So does a busy CPU.
        let busy = LifecycleFacts {
            cpu: Sampled {
                active_at: Some(at(7000)),
                sampled_at: Some(at(7000)),
                percent: Some(99.0),
            },
            ..connected.clone()
        };
        assert_eq!(next(&busy, at(7100)), Some((at(14_200), HoldReason::Idle)));
        // Without a connection, the no-connection wording stays.
        let gone = LifecycleFacts {
            state: SessionState::Idle,
            open_connections: Vec::new(),
            last_close_at: Some(at(100)),
            ..waiting()
        };
        let planned = evaluate(&gone, &config(), at(200)).next.unwrap();
        assert!(
            planned.details.starts_with("no SSH connection"),
            "{}",
            planned.details
        );
        assert_eq!(view(&gone, &config(), at(7000)).connected_idle_since, None);
    }

    #[test]
    fn with_open_connection_keeps_alive_a_live_connection_keeps_a_session_until_it_goes_stale() {
        let config = || LifecycleConfig {
            open_connection_keeps_alive: true,
            ..super::tests::config()
        };
        let next = |facts: &LifecycleFacts, now| {
            evaluate(facts, &config(), now)
                .next
                .map(|p| (p.hold.at, p.hold.reason))
        };
        let connected = LifecycleFacts {
            state: SessionState::Connected,
            open_connections: vec![at(5000)],
            ..waiting()
        };
        let evaluation = evaluate(&connected, &config(), at(5100));
        assert_eq!(evaluation.kept_alive_by, Some(SignalKind::Connection));
        assert_eq!(
            evaluation.next.map(|p| p.hold.reason),
            Some(HoldReason::MaxDuration)
        );
        // The gateway stopped reporting it (died without a close): 3 minutes later it is stale,
        // and the idle timeout counts from its last report.
        let evaluation = evaluate(&connected, &config(), at(5181));
        assert_eq!(evaluation.kept_alive_by, Some(SignalKind::Connection));
        assert_eq!(
            next(&connected, at(5181)),
            Some((at(5000 + 7200), HoldReason::Idle))
        );
        assert_eq!(connected.live_connections(&config(), at(5180)), 1);
        assert_eq!(connected.live_connections(&config(), at(5181)), 0);
    }

    #[test]
    fn every_activity_signal_defers_the_idle_hold() {
        let base = idle_since(100);
        assert_eq!(next(&base, at(100)), Some((at(7300), HoldReason::Idle)));
        let sampled = |t: i64| Sampled {
            active_at: Some(at(t)),
            sampled_at: Some(at(t)),
            percent: Some(50.0),
        };
        let cases = [
            (
                SignalKind::SshTraffic,
                LifecycleFacts {
                    last_traffic_at: Some(at(1000)),
                    ..base.clone()
                },
            ),
            (
                SignalKind::Cpu,
                LifecycleFacts {
                    cpu: sampled(1000),
                    ..base.clone()
                },
            ),
            (
                SignalKind::Gpu,
                LifecycleFacts {
                    gpu: sampled(1000),
                    ..base.clone()
                },
            ),
        ];
        for (kind, facts) in cases {
            let evaluation = evaluate(&facts, &config(), at(1000));
            let planned = evaluation.next.unwrap();
            assert_eq!(planned.hold.at, at(8200), "{kind:?}");
            assert_eq!(planned.hold.reason, HoldReason::Idle);
            assert_eq!(evaluation.kept_alive_by, Some(kind));
            assert!(
                planned
                    .details
                    .starts_with("no SSH connection and no activity"),
                "{}",
                planned.details
            );
            // Once the timeout has run out, nothing keeps it.
            assert_eq!(evaluate(&facts, &config(), at(8200)).kept_alive_by, None);
        }
        // A sample below the threshold is stored with its value but is no activity.
        let quiet = LifecycleFacts {
            cpu: Sampled {
                active_at: None,
                sampled_at: Some(at(1000)),
                percent: Some(1.0),
            },
            ..base.clone()
        };
        assert_eq!(next(&quiet, at(1000)), Some((at(7300), HoldReason::Idle)));
        // The latest signal wins.
        let both = LifecycleFacts {
            cpu: sampled(3000),
            last_traffic_at: Some(at(2000)),
            ..base
        };
        let evaluation = evaluate(&both, &config(), at(3000));
        assert_eq!(evaluation.kept_alive_by, Some(SignalKind::Cpu));
        assert_eq!(evaluation.next.unwrap().hold.at, at(10_200));
    }

    #[test]
    fn a_per_session_idle_timeout_applies() {
        let facts = LifecycleFacts {
            idle_timeout_secs: Some(600),
            ..idle_since(1000)
        };
        assert_eq!(next(&facts, at(1000)), Some((at(1600), HoldReason::Idle)));
        assert_eq!(
            deadlines(&facts, &config(), at(1000)).idle_timeout_secs,
            600
        );
    }

    #[test]
    fn a_keep_alive_defers_idle_and_no_connection_holds_and_is_capped() {
        let now = at(1000);
        let until = keep_until(&config(), Duration::from_secs(4 * 3600), now);
        assert_eq!(until, at(1000 + 4 * 3600));
        let capped = keep_until(&config(), Duration::from_secs(100 * 3600), now);
        assert_eq!(capped, at(1000 + 12 * 3600), "capped by keep_max");

        let kept = LifecycleFacts {
            keep_until: Some(until),
            ..idle_since(100)
        };
        let evaluation = evaluate(&kept, &config(), now);
        assert_eq!(evaluation.kept_alive_by, Some(SignalKind::Keep));
        assert_eq!(
            evaluation.next.as_ref().map(|p| (p.hold.at, p.hold.reason)),
            Some((until, HoldReason::Idle))
        );
        assert!(evaluation
            .next
            .unwrap()
            .details
            .contains("the keep-alive ended at"));

        let waiting = LifecycleFacts {
            keep_until: Some(until),
            ..waiting()
        };
        assert_eq!(next(&waiting, now), Some((until, HoldReason::NoConnection)));
        assert_eq!(
            evaluate(&waiting, &config(), now).kept_alive_by,
            Some(SignalKind::Keep)
        );
        // A keep from before the last release does not count.
        let stale_keep = LifecycleFacts {
            keep_until: Some(at(-10)),
            ..waiting
        };
        assert_eq!(
            next(&stale_keep, now),
            Some((at(1200), HoldReason::NoConnection))
        );
    }

    #[test]
    fn the_maximum_lifetime_counts_from_the_first_start_whatever_happens() {
        let mut facts = LifecycleFacts {
            state: SessionState::Connected,
            open_connections: vec![at(7 * 86_400)],
            // Typing right now: only the maximum lifetime can hold it.
            last_traffic_at: Some(at(7 * 86_400)),
            max_duration_secs: Some(7 * 86_400),
            ..waiting()
        };
        // Released after a hold: ready again much later; the lifetime still counts from t0.
        facts.ready_at = Some(at(3 * 86_400));
        let now = at(7 * 86_400);
        let planned = evaluate(&facts, &config(), now).next.unwrap();
        assert_eq!(
            planned.hold,
            PlannedHold {
                at: now,
                reason: HoldReason::MaxDuration
            }
        );
        assert_eq!(
            planned.sentence(),
            "max-duration: the session reached its maximum lifetime of 1 week (first started \
             at 2023-11-14 22:13:20 UTC)"
        );
        assert_eq!(deadlines(&facts, &config(), now).max_end_at, Some(now));
    }

    #[test]
    fn only_running_sessions_are_held() {
        for state in SessionState::ALL {
            let facts = LifecycleFacts { state, ..waiting() };
            let planned = next(&facts, at(100_000)).is_some();
            let running = matches!(
                state,
                SessionState::Waiting | SessionState::Connected | SessionState::Idle
            );
            assert_eq!(planned, running, "{state}");
        }
    }

    #[test]
    fn an_overdue_hold_says_when_it_was_due() {
        let planned = evaluate(&waiting(), &config(), at(1200)).next.unwrap();
        assert_eq!(hold_details(&planned, at(1205)), planned.details);
        let late = hold_details(&planned, at(5000));
        assert!(
            late.starts_with("nobody connected within 20 minutes"),
            "{late}"
        );
        assert!(late.ends_with("(due at 2023-11-14 22:33:20 UTC)"), "{late}");
    }

    #[test]
    fn the_view_answers_why_a_session_is_alive() {
        let facts = LifecycleFacts {
            cpu: Sampled {
                active_at: Some(at(2000)),
                sampled_at: Some(at(2100)),
                percent: Some(3.0),
            },
            open_connections: vec![at(100)],
            ..idle_since(50)
        };
        let view = view(&facts, &config(), at(2100));
        assert_eq!(view.kept_alive_by, Some(SignalKind::Cpu));
        assert_eq!(
            view.deadlines.next_hold,
            Some(PlannedHold {
                at: at(9200),
                reason: HoldReason::Idle
            })
        );
        let connection = &view.signals[0];
        assert_eq!(connection.kind, SignalKind::Connection);
        assert_eq!(connection.last_seen, Some(at(100)));
        assert_eq!(
            connection.detail.as_deref(),
            Some("0 open, 1 not reported for over 3 minutes")
        );
        let cpu = &view.signals[2];
        assert_eq!(cpu.last_seen, Some(at(2000)));
        assert_eq!(
            cpu.detail.as_deref(),
            Some("last sample 3% CPU at 2023-11-14 22:48:20 UTC (threshold 5%)")
        );
    }

    #[test]
    fn config_defaults_and_limits() {
        let config = LifecycleConfig::default();
        assert_eq!(config, self::config());
        assert_eq!(config.limits_for(None, None), Ok((7200, 7 * 86_400)));
        assert_eq!(config.limits_for(Some(60), Some(3600)), Ok((60, 3600)));
        let err = config.limits_for(Some(9 * 3600), None).unwrap_err();
        assert_eq!(
            err,
            "--idle-timeout 9 hours is more than this site allows (8 hours): ask for 8 hours or \
             less"
        );
        assert!(config.limits_for(None, Some(15 * 86_400)).is_err());
        assert!(config.limits_for(Some(0), None).is_err());
        // The longest durations the config accepts do not overflow the deadlines.
        let longest = LifecycleConfig {
            max_idle_timeout: LONGEST,
            keep_max: LONGEST,
            ..config
        };
        let facts = LifecycleFacts {
            idle_timeout_secs: Some(LONGEST.as_secs()),
            keep_until: Some(keep_until(&longest, LONGEST, at(100))),
            ..idle_since(100)
        };
        assert!(evaluate(&facts, &longest, at(100)).next.is_some());
    }

    #[test]
    fn a_due_hold_is_a_change_to_held_with_its_reason() {
        let facts = waiting();
        assert_eq!(due_hold(&facts, &config(), at(1199)), None);
        let (change, reason) = due_hold(&facts, &config(), at(1200)).unwrap();
        assert_eq!(reason, HoldReason::NoConnection);
        assert_eq!(change.to, SessionState::Held);
        assert_eq!(change.at, at(1200));
        assert_eq!(change.placement, super::super::Placement::Keep);
        assert_eq!(change.hold, Some(HoldReason::NoConnection));
        assert!(
            change.reason.starts_with("nobody connected within"),
            "{}",
            change.reason
        );
        assert!(
            change
                .sentence()
                .starts_with("no-connection: nobody connected within"),
            "{}",
            change.sentence()
        );
        let (late, _) = due_hold(&facts, &config(), at(5000)).unwrap();
        assert_eq!(late.at, at(5000), "applied when it is applied");
        assert!(
            late.reason.ends_with("(due at 2023-11-14 22:33:20 UTC)"),
            "{}",
            late.reason
        );
    }
}
