//! How long each phase of one sync took, so that a slow sync says where its time went.
//!
//! The manager declares a node lost when its agent has not synced for `node_timeout`; a sync
//! that waits seconds on a busy Docker or disk comes close to that without any error. Each
//! sync is logged at DEBUG with its phases; one slower than [`SLOW_SYNC`] is a WARN naming the
//! slowest phase, which is where an admin looks first.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// A sync slower than this is logged as a warning.
pub const SLOW_SYNC: Duration = Duration::from_secs(3);

/// One phase of a sync, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// GPU discovery (`GpuBackend::discover`).
    Gpus,
    /// Listing the node's containers in Docker.
    Containers,
    /// Reading each running container's CPU use (its cgroup's counter, else Docker's stats).
    Activity,
    /// Registering (when the inventory changed) and the report to the manager.
    Manager,
    /// Converging containers, images, freezes, jobs and MIG to the answer.
    Converge,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Self::Gpus => "GPU discovery",
            Self::Containers => "listing containers",
            Self::Activity => "reading containers' CPU use",
            Self::Manager => "the report to the manager",
            Self::Converge => "converging",
        }
    }
}

/// The phases of one sync as they end.
#[derive(Debug)]
pub struct SyncTimes {
    started: Instant,
    last: Instant,
    phases: Vec<(Phase, Duration)>,
}

impl SyncTimes {
    pub fn start() -> Self {
        let now = Instant::now();
        Self {
            started: now,
            last: now,
            phases: Vec::with_capacity(5),
        }
    }

    /// `phase` ended now; it began where the one before ended.
    pub fn ended(&mut self, phase: Phase) {
        let now = Instant::now();
        self.phases.push((phase, now - self.last));
        self.last = now;
    }

    pub fn total(&self) -> Duration {
        self.last - self.started
    }

    /// The phase that took longest, if any ended.
    pub fn slowest(&self) -> Option<(Phase, Duration)> {
        self.phases.iter().copied().max_by_key(|(_, took)| *took)
    }

    pub fn is_slow(&self) -> bool {
        self.total() > SLOW_SYNC
    }
}

impl fmt::Display for SyncTimes {
    /// `GPU discovery 0.001 s, listing containers 0.012 s, ...`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (phase, took)) in self.phases.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {:.3} s", phase.name(), took.as_secs_f64())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_slowest_phase_is_named_and_a_slow_sync_told_apart() {
        let mut times = SyncTimes::start();
        tokio::time::advance(Duration::from_millis(10)).await;
        times.ended(Phase::Gpus);
        tokio::time::advance(Duration::from_millis(3_200)).await;
        times.ended(Phase::Activity);
        tokio::time::advance(Duration::from_millis(40)).await;
        times.ended(Phase::Manager);
        assert_eq!(times.total(), Duration::from_millis(3_250));
        assert!(times.is_slow());
        assert_eq!(
            times.slowest(),
            Some((Phase::Activity, Duration::from_millis(3_200)))
        );
        assert_eq!(
            times.to_string(),
            "GPU discovery 0.010 s, reading containers' CPU use 3.200 s, the report to the manager 0.040 s"
        );

        let mut quick = SyncTimes::start();
        tokio::time::advance(Duration::from_millis(900)).await;
        quick.ended(Phase::Converge);
        assert!(!quick.is_slow());
    }
}
