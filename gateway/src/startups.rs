//! A cap on connections that have not authenticated yet, per source address and in total, as
//! OpenSSH's `PerSourceMaxStartups` and `MaxStartups start:rate:full` do: below `start`
//! unauthenticated connections everyone is admitted; from `start` on a new one is refused with
//! a probability that grows linearly from `rate` percent to 100 % at `full`; at `full` every new
//! one is refused. One address may hold at most `per_source` of them. A refused connection is
//! closed before the gateway sends a single SSH byte (`server.rs`).
//!
//! A connection counts from its admission until it authenticates or ends, whichever comes
//! first ([`StartupPermit`] is dropped then). So a flood of idle TCP connections from one
//! address cannot take the slots of the users of other institutes, and one that fills the
//! total only slows new logins down while it lasts (each slot is freed after the login grace
//! time at the latest).

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

/// The limits (`max_startups` and `per_source_max_startups` in the gateway's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartupLimits {
    /// Unauthenticated connections admitted without question.
    pub start: u32,
    /// The percentage refused at `start`, growing linearly to 100 at `full`.
    pub rate: u32,
    /// Unauthenticated connections beyond which every new one is refused.
    pub full: u32,
    /// Unauthenticated connections one address may hold.
    pub per_source: u32,
}

impl Default for StartupLimits {
    /// `100:30:1000` and 50 per address: ten times OpenSSH's `10:30:100`, as one gateway serves
    /// a whole site, and a generous per-address share because an institute's users may all
    /// come from one NAT address (and VS Code opens several connections at once).
    fn default() -> Self {
        Self {
            start: 100,
            rate: 30,
            full: 1000,
            per_source: 50,
        }
    }
}

impl StartupLimits {
    /// Parses OpenSSH's `start:rate:full` (or a single number, meaning `start` = `full`).
    pub fn parse_max_startups(text: &str) -> Result<(u32, u32, u32), String> {
        let numbers = text
            .split(':')
            .map(|part| part.trim().parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| format!("{text:?} is not start:rate:full, like \"100:30:1000\""))?;
        let (start, rate, full) = match numbers[..] {
            [start] => (start, 100, start),
            [start, rate, full] => (start, rate, full),
            _ => {
                return Err(format!(
                    "{text:?} is not start:rate:full, like \"100:30:1000\""
                ))
            }
        };
        if start == 0 {
            return Err(format!("{text:?}: start must be at least 1"));
        }
        if !(1..=100).contains(&rate) {
            return Err(format!("{text:?}: rate is a percentage, from 1 to 100"));
        }
        if full < start {
            return Err(format!("{text:?}: full must be at least start"));
        }
        Ok((start, rate, full))
    }

    /// The percentage of new connections refused while `current` are unauthenticated.
    pub fn refusal_percent(&self, current: u32) -> u32 {
        if current < self.start {
            return 0;
        }
        if current >= self.full {
            return 100;
        }
        // As OpenSSH's drop_connection(): rate at start, linearly up to 100 at full.
        let span = u64::from(self.full - self.start);
        let above = u64::from(current - self.start);
        let rate = u64::from(self.rate);
        let percent = rate + (100 - rate) * above / span;
        u32::try_from(percent).unwrap_or(100)
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartupRefusal {
    /// The address already holds `limit` unauthenticated connections.
    PerSource { limit: u32 },
    /// `total` unauthenticated connections: past `start`, this one was refused at random (or
    /// all are, at `full`).
    Total { total: u32, percent: u32 },
}

impl fmt::Display for StartupRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PerSource { limit } => write!(
                f,
                "the address already has {limit} connections that have not logged in (per_source_max_startups)"
            ),
            Self::Total { total, percent } => write!(
                f,
                "{total} connections have not logged in yet; {percent} % of new ones are refused (max_startups)"
            ),
        }
    }
}

/// A percentage drawn at random, 0 to 99.
type Dice = dyn Fn() -> u32 + Send + Sync;

/// The unauthenticated connections in progress; cloned handles share them.
#[derive(Clone)]
pub struct Startups {
    inner: Arc<Inner>,
}

struct Inner {
    limits: StartupLimits,
    counts: Mutex<Counts>,
    dice: Box<Dice>,
}

#[derive(Debug, Default)]
struct Counts {
    total: u32,
    per_source: HashMap<IpAddr, u32>,
}

impl fmt::Debug for Startups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Startups")
            .field("limits", &self.inner.limits)
            .field("counts", &*self.inner.lock())
            .finish()
    }
}

impl Startups {
    pub fn new(limits: StartupLimits) -> Self {
        Self::with_dice(limits, Box::new(|| rand::random_range(0..100)))
    }

    /// With `dice` instead of real randomness (tests).
    pub fn with_dice(limits: StartupLimits, dice: Box<Dice>) -> Self {
        Self {
            inner: Arc::new(Inner {
                limits,
                counts: Mutex::new(Counts::default()),
                dice,
            }),
        }
    }

    /// Admits a new connection from `source` (normalised), or says why not.
    pub fn admit(&self, source: IpAddr) -> Result<StartupPermit, StartupRefusal> {
        let limits = self.inner.limits;
        let mut counts = self.inner.lock();
        let from_source = counts.per_source.get(&source).copied().unwrap_or(0);
        if from_source >= limits.per_source {
            return Err(StartupRefusal::PerSource {
                limit: limits.per_source,
            });
        }
        let percent = limits.refusal_percent(counts.total);
        if percent > 0 && (self.inner.dice)() < percent {
            return Err(StartupRefusal::Total {
                total: counts.total,
                percent,
            });
        }
        counts.total += 1;
        *counts.per_source.entry(source).or_insert(0) += 1;
        Ok(StartupPermit {
            inner: self.inner.clone(),
            source,
        })
    }

    /// Unauthenticated connections now: in total, and from `source`.
    pub fn current(&self, source: IpAddr) -> (u32, u32) {
        let counts = self.inner.lock();
        let from_source = counts.per_source.get(&source).copied().unwrap_or(0);
        (counts.total, from_source)
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Counts> {
        // Plain counters: a panic elsewhere cannot leave them half-updated.
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One admitted connection's slot, freed when dropped (at authentication or at its end).
pub struct StartupPermit {
    inner: Arc<Inner>,
    source: IpAddr,
}

impl fmt::Debug for StartupPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StartupPermit")
            .field("source", &self.source)
            .finish()
    }
}

impl Drop for StartupPermit {
    fn drop(&mut self) {
        let mut counts = self.inner.lock();
        counts.total = counts.total.saturating_sub(1);
        if let Some(count) = counts.per_source.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                counts.per_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn limits(start: u32, rate: u32, full: u32, per_source: u32) -> StartupLimits {
        StartupLimits {
            start,
            rate,
            full,
            per_source,
        }
    }

    #[test]
    fn max_startups_is_parsed_as_openssh_does() {
        assert_eq!(
            StartupLimits::parse_max_startups("10:30:100"),
            Ok((10, 30, 100))
        );
        assert_eq!(StartupLimits::parse_max_startups("20"), Ok((20, 100, 20)));
        for bad in [
            "",
            "a",
            "10:30",
            "0:30:100",
            "10:0:100",
            "10:101:100",
            "10:30:5",
            "1:2:3:4",
        ] {
            assert!(StartupLimits::parse_max_startups(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_refusal_rate_grows_from_rate_at_start_to_all_at_full() {
        let limits = limits(10, 30, 100, 5);
        assert_eq!(limits.refusal_percent(0), 0);
        assert_eq!(limits.refusal_percent(9), 0);
        assert_eq!(limits.refusal_percent(10), 30);
        assert_eq!(limits.refusal_percent(55), 65);
        assert_eq!(limits.refusal_percent(99), 99);
        assert_eq!(limits.refusal_percent(100), 100);
        assert_eq!(limits.refusal_percent(5000), 100);
        let sharp = StartupLimits {
            rate: 100,
            full: 10,
            ..limits
        };
        assert_eq!(sharp.refusal_percent(10), 100);
    }

    #[test]
    fn one_address_cannot_take_more_than_its_share() {
        let startups = Startups::new(limits(100, 30, 1000, 2));
        let a1 = startups.admit(ip("192.0.2.1")).unwrap();
        let _a2 = startups.admit(ip("192.0.2.1")).unwrap();
        assert_eq!(
            startups.admit(ip("192.0.2.1")).unwrap_err(),
            StartupRefusal::PerSource { limit: 2 }
        );
        // Others are not affected.
        let _b = startups.admit(ip("198.51.100.7")).unwrap();
        assert_eq!(startups.current(ip("192.0.2.1")), (3, 2));
        // A slot comes back when its connection authenticates or ends.
        drop(a1);
        assert_eq!(startups.current(ip("192.0.2.1")), (2, 1));
        let _a3 = startups.admit(ip("192.0.2.1")).unwrap();
    }

    #[test]
    fn past_start_connections_are_refused_at_random_and_all_at_full() {
        // A connection is refused when the roll is below the refusal percentage.
        let roll = Arc::new(AtomicU32::new(99));
        let dice = roll.clone();
        let startups = Startups::with_dice(
            limits(2, 40, 6, 100),
            Box::new(move || dice.load(Ordering::SeqCst)),
        );
        let mut held = Vec::new();
        for n in 0..4 {
            held.push(
                startups
                    .admit(IpAddr::from([192, 0, 2, n]))
                    .unwrap_or_else(|e| panic!("{n}: {e}")),
            );
        }
        // 4 held: 40 + 60 * 2 / 4 = 70 % refused; a roll of 50 loses.
        roll.store(50, Ordering::SeqCst);
        assert_eq!(
            startups.admit(ip("203.0.113.1")).unwrap_err(),
            StartupRefusal::Total {
                total: 4,
                percent: 70
            }
        );
        // A lucky roll gets through, up to full.
        roll.store(95, Ordering::SeqCst);
        held.push(startups.admit(ip("203.0.113.1")).unwrap());
        held.push(startups.admit(ip("203.0.113.2")).unwrap());
        roll.store(99, Ordering::SeqCst);
        assert!(matches!(
            startups.admit(ip("203.0.113.3")),
            Err(StartupRefusal::Total { percent: 100, .. })
        ));
        held.clear();
        roll.store(0, Ordering::SeqCst);
        assert_eq!(startups.current(ip("203.0.113.1")), (0, 0));
        let _again = startups.admit(ip("203.0.113.3")).unwrap();
    }
}
