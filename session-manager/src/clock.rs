//! Where the manager gets the time from. Injected everywhere time matters, so that tests set the
//! time instead of sleeping.

use std::fmt;
use std::sync::Mutex;

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::watch;

pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> DateTime<Utc>;

    /// Told each time the clock jumps, for a clock that does not move by itself: the loops that
    /// run on a timer (the scheduling round) run once more, as they would have while that time
    /// passed. `None` for the wall clock, whose time the timers follow.
    fn jumps(&self) -> Option<watch::Receiver<DateTime<Utc>>> {
        None
    }
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that stands still until told to move. For tests.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<DateTime<Utc>>,
    jumped: watch::Sender<DateTime<Utc>>,
}

impl ManualClock {
    pub fn new(now: DateTime<Utc>) -> Self {
        Self {
            now: Mutex::new(now),
            jumped: watch::channel(now).0,
        }
    }

    pub fn advance(&self, by: TimeDelta) {
        let mut now = self
            .now
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *now += by;
        self.jumped.send_replace(*now);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self
            .now
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn jumps(&self) -> Option<watch::Receiver<DateTime<Utc>>> {
        Some(self.jumped.subscribe())
    }
}
