//! What events do to a session's lifecycle facts, the input of the hold policy ([`super::holds`]):
//! a change of state ([`after_transition`]: ready, re-queued) and an agent's activity sample
//! ([`activity_sample`]: whether it counts as activity; [`reading_due`]: whether it must be
//! written now). The store writes what these return in the same transaction as the event itself.

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::holds::ContainerActivity;
use ongrid_core::{SessionState, Transition};

use super::holds::{ActivityThresholds, Sampled};

/// What a change of state does to the session's lifecycle facts and its place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FactsChange {
    /// Its container runs: ready from `ready_at`, and first started then unless it started
    /// before (max-duration counts from the first start, which the store keeps).
    Ready { ready_at: DateTime<Utc> },
    /// Released: at the end of the queue from `queued_at`, its readiness and keep-alive
    /// forgotten. The GPUs its held container was made with stay recorded: the scheduler gives
    /// them back when they are free (a PENDING session holds no GPUs, whatever they say).
    Requeued { queued_at: DateTime<Utc> },
}

/// What `transition` changes in the facts; `None` when nothing.
///
/// STARTING → WAITING is a start; HELD → PENDING is a release.
pub fn after_transition(transition: &Transition) -> Option<FactsChange> {
    match (transition.from, transition.to) {
        (Some(SessionState::Starting), SessionState::Waiting) => Some(FactsChange::Ready {
            ready_at: transition.at,
        }),
        (Some(SessionState::Held), SessionState::Pending) => Some(FactsChange::Requeued {
            queued_at: transition.at,
        }),
        _ => None,
    }
}

/// One measure of an activity sample, as it is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub percent: f64,
    pub sampled_at: DateTime<Utc>,
    /// At or above the site's threshold: the session was in use at `sampled_at`.
    pub active: bool,
}

/// An activity sample as it is stored: CPU always, GPU when the agent knew it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleFacts {
    pub cpu: Reading,
    pub gpu: Option<Reading>,
}

/// What an agent's sample, received at `at` (the manager's clock), records: each measure, and
/// whether it counts as activity (at or above its threshold). `None` when the CPU percentage is
/// not a number (the sample is ignored); a GPU percentage that is not one is left out.
pub fn activity_sample(
    sample: &ContainerActivity,
    thresholds: ActivityThresholds,
    at: DateTime<Utc>,
) -> Option<SampleFacts> {
    let reading = |percent: f64, threshold: f64| Reading {
        percent,
        sampled_at: at,
        active: percent >= threshold,
    };
    if !sample.cpu_percent.is_finite() {
        return None;
    }
    Some(SampleFacts {
        cpu: reading(sample.cpu_percent, thresholds.cpu_percent),
        gpu: sample
            .gpu_percent
            .filter(|p| p.is_finite())
            .map(|p| reading(p, thresholds.gpu_percent)),
    })
}

/// The longest a session's stored reading of a measure waits for a newer one while the newer
/// ones change nothing the hold policy reads.
pub const READING_REWRITTEN_EVERY: TimeDelta = TimeDelta::minutes(1);

/// How often a reading that changes nothing the policy reads is written for a session idle
/// after `idle_timeout`: every [`READING_REWRITTEN_EVERY`], or every eighth of its idle timeout
/// when that is shorter, so that its activity as stored never lags by more than a small part of
/// the time it has, nor by as much as `session show` waits before it calls a connected session
/// idle (a quarter of its idle timeout, five minutes at most). The activity seen but not written
/// is written when the manager stops; one that crashes loses at most this much of it.
pub fn rewritten_every(idle_timeout: TimeDelta) -> TimeDelta {
    (idle_timeout / 8).min(READING_REWRITTEN_EVERY)
}

/// Whether the `latest` reading of one measure must be written now over what is stored
/// (`stored`; `threshold` tells whether its reading was active), `last_active` being the last
/// active reading seen, stored or not:
/// - nothing is stored yet;
/// - it turned active or idle: the policy counts idleness from the last activity;
/// - the stored reading is idle and activity came since: the idle countdown starts again;
/// - the stored reading is active but no activity is stored with it (the site's threshold was
///   lowered since it was written);
/// - the stored one is `every` old ([`rewritten_every`]; the managers' clocks are taken to agree
///   within it).
///
/// Otherwise it waits: an agent samples each container at every sync (a few seconds apart), and
/// a site of a thousand nodes would rewrite every running session's row that often, while all
/// the policy reads (the last activity) moves only by the few seconds between samples of a
/// session that stays busy.
pub fn reading_due(
    stored: &Sampled,
    threshold: f64,
    latest: Reading,
    last_active: Option<DateTime<Utc>>,
    every: TimeDelta,
) -> bool {
    let (Some(sampled_at), Some(percent)) = (stored.sampled_at, stored.percent) else {
        return true;
    };
    let was_active = percent >= threshold;
    was_active != latest.active
        || (!was_active && last_active > stored.active_at)
        || (was_active && stored.active_at.is_none())
        || latest.sampled_at - sampled_at >= every
}

#[cfg(test)]
mod tests {
    use ongrid_core::SessionId;

    use super::*;
    use crate::domain::fixtures::t;

    fn transition(from: SessionState, to: SessionState, at: DateTime<Utc>) -> Transition {
        Transition {
            from: Some(from),
            to,
            at,
            reason: String::new(),
        }
    }

    #[test]
    fn a_start_makes_the_session_ready() {
        let start = transition(SessionState::Starting, SessionState::Waiting, t(100));
        assert_eq!(
            after_transition(&start),
            Some(FactsChange::Ready { ready_at: t(100) })
        );
    }

    #[test]
    fn a_release_requeues_and_other_changes_leave_the_facts() {
        let release = transition(SessionState::Held, SessionState::Pending, t(200));
        assert_eq!(
            after_transition(&release),
            Some(FactsChange::Requeued { queued_at: t(200) })
        );
        for (from, to) in [
            (SessionState::Pending, SessionState::Starting),
            (SessionState::Waiting, SessionState::Connected),
            (SessionState::Idle, SessionState::Held),
            (SessionState::Starting, SessionState::Pending),
            (SessionState::Held, SessionState::Ended),
        ] {
            assert_eq!(
                after_transition(&transition(from, to, t(300))),
                None,
                "{from} -> {to}"
            );
        }
        let created = Transition {
            from: None,
            to: SessionState::Pending,
            at: t(0),
            reason: String::new(),
        };
        assert_eq!(after_transition(&created), None);
    }

    fn sample(cpu: f64, gpu: Option<f64>) -> ContainerActivity {
        ContainerActivity {
            session_id: SessionId::new_random(),
            sampled_at: t(-30),
            cpu_percent: cpu,
            gpu_percent: gpu,
        }
    }

    const THRESHOLDS: ActivityThresholds = ActivityThresholds {
        cpu_percent: 5.0,
        gpu_percent: 10.0,
    };

    #[test]
    fn a_sample_counts_as_activity_at_or_above_its_threshold() {
        let facts = activity_sample(&sample(5.0, Some(9.9)), THRESHOLDS, t(50)).unwrap();
        assert_eq!(
            facts.cpu,
            Reading {
                percent: 5.0,
                sampled_at: t(50),
                active: true
            }
        );
        assert_eq!(
            facts.gpu,
            Some(Reading {
                percent: 9.9,
                sampled_at: t(50),
                active: false
            })
        );
        let facts = activity_sample(&sample(4.99, Some(10.0)), THRESHOLDS, t(50)).unwrap();
        assert!(!facts.cpu.active);
        assert!(facts.gpu.unwrap().active);
        // Each measure has its own threshold.
        let facts = activity_sample(&sample(7.0, Some(7.0)), THRESHOLDS, t(50)).unwrap();
        assert!(facts.cpu.active);
        assert!(!facts.gpu.unwrap().active);
    }

    #[test]
    fn samples_that_are_not_numbers_are_left_out() {
        assert_eq!(
            activity_sample(&sample(f64::NAN, Some(50.0)), THRESHOLDS, t(1)),
            None
        );
        assert_eq!(
            activity_sample(&sample(f64::INFINITY, None), THRESHOLDS, t(1)),
            None
        );
        let facts = activity_sample(&sample(1.0, Some(f64::NAN)), THRESHOLDS, t(1)).unwrap();
        assert_eq!(facts.gpu, None);
        let facts = activity_sample(&sample(1.0, None), THRESHOLDS, t(1)).unwrap();
        assert_eq!(facts.gpu, None);
    }

    #[test]
    fn a_reading_is_written_when_it_changes_what_the_policy_reads_or_is_a_while_old() {
        let every = rewritten_every(TimeDelta::hours(2));
        assert_eq!(every, TimeDelta::minutes(1));
        assert!(
            every < TimeDelta::hours(2) / 4,
            "before `session show` calls it idle"
        );
        let stored = |at: i64, percent: f64, active_at: Option<i64>| Sampled {
            sampled_at: Some(t(at)),
            percent: Some(percent),
            active_at: active_at.map(t),
        };
        let reading = |at: i64, active: bool| Reading {
            percent: if active { 90.0 } else { 1.0 },
            sampled_at: t(at),
            active,
        };
        let due = |stored: Sampled, latest: Reading, last_active: Option<i64>| {
            reading_due(&stored, 5.0, latest, last_active.map(t), every)
        };
        // Nothing stored yet.
        assert!(due(Sampled::default(), reading(0, false), None));
        // Idle after idle, busy after busy: they wait, for a minute.
        assert!(!due(stored(0, 1.0, None), reading(5, false), None));
        assert!(!due(stored(0, 90.0, Some(0)), reading(59, true), Some(59)));
        assert!(due(stored(0, 1.0, None), reading(60, false), None));
        assert!(due(stored(0, 90.0, Some(0)), reading(60, true), Some(60)));
        // It turned: busy after idle, idle after busy.
        assert!(due(stored(0, 1.0, None), reading(5, true), Some(5)));
        assert!(due(stored(0, 90.0, Some(0)), reading(5, false), Some(0)));
        // Busy for a moment since the stored idle reading: the countdown starts again.
        assert!(due(stored(0, 1.0, Some(-50)), reading(10, false), Some(5)));
        assert!(!due(
            stored(0, 1.0, Some(-50)),
            reading(10, false),
            Some(-50)
        ));
        // At the threshold is active: busy after busy waits, idle after it is written.
        let at_threshold = Reading {
            percent: 5.0,
            sampled_at: t(5),
            active: true,
        };
        assert!(!due(stored(0, 5.0, Some(0)), at_threshold, Some(5)));
        assert!(due(stored(0, 5.0, Some(0)), reading(5, false), Some(0)));
        // Stored as busy without activity (the threshold was lowered since): written.
        assert!(due(stored(0, 7.0, None), reading(5, true), Some(5)));
        // Stored idle with no activity ever, activity since: written.
        assert!(due(stored(0, 1.0, None), reading(10, false), Some(5)));
        // A short idle timeout rewrites more often: at an eighth of it.
        assert_eq!(
            rewritten_every(TimeDelta::seconds(40)),
            TimeDelta::seconds(5)
        );
    }
}
