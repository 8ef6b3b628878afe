//! Throttling of failed logins, per source address and per SSH user name: a token bucket each
//! (by default 10 failures, refilled at 10 a minute). While either bucket of an attempt is
//! empty the attempt is refused at once, without asking the manager. Time is tokio's clock, so
//! tests drive it with paused time.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How many failures are tolerated, and how fast that allowance comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Failures allowed in a burst (the bucket's size).
    pub burst: u32,
    /// The time in which a whole burst is refilled.
    pub refill: Duration,
}

impl Default for Policy {
    /// 10 failures, then one more every 6 seconds (10 a minute).
    fn default() -> Self {
        Self {
            burst: 10,
            refill: Duration::from_secs(60),
        }
    }
}

/// Which bucket refused an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThrottledBy {
    Address,
    User,
}

/// An attempt refused by the throttle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled {
    pub by: ThrottledBy,
    /// When the next attempt would be let through.
    pub retry_after: Duration,
}

/// Buckets beyond this many per kind trigger pruning of the full ones.
const PRUNE_ABOVE: usize = 10_000;
/// If pruning cannot bring a map under this, it is cleared (a spray from many addresses).
const HARD_LIMIT: usize = 100_000;
/// User names are compared case-insensitively and cut to this length.
const USER_KEY_LEN: usize = 64;

#[derive(Debug)]
pub struct Throttle {
    policy: Policy,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    addresses: HashMap<IpAddr, Bucket>,
    users: HashMap<String, Bucket>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Throttle {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            state: Mutex::new(State::default()),
        }
    }

    /// `Err` when the address or the user has no failure left to spend.
    pub fn check(&self, address: IpAddr, user: &str) -> Result<(), Throttled> {
        let now = Instant::now();
        let policy = self.policy;
        let state = self.lock();
        let address_wait = wait_of(state.addresses.get(&address), policy, now);
        let user_wait = wait_of(state.users.get(&user_key(user)), policy, now);
        drop(state);
        match (address_wait, user_wait) {
            (Some(retry_after), _) => Err(Throttled {
                by: ThrottledBy::Address,
                retry_after,
            }),
            (None, Some(retry_after)) => Err(Throttled {
                by: ThrottledBy::User,
                retry_after,
            }),
            (None, None) => Ok(()),
        }
    }

    /// Spends one failure from both buckets.
    pub fn failure(&self, address: IpAddr, user: &str) {
        self.change(address, user, -1.0);
    }

    /// Gives one failure back (a connection that failed a probe and then logged in).
    pub fn refund(&self, address: IpAddr, user: &str) {
        self.change(address, user, 1.0);
    }

    fn change(&self, address: IpAddr, user: &str, delta: f64) {
        let now = Instant::now();
        let policy = self.policy;
        let mut state = self.lock();
        let State { addresses, users } = &mut *state;
        apply(addresses, address, delta, policy, now);
        apply(users, user_key(user), delta, policy, now);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the maps inconsistent: keep going.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn user_key(user: &str) -> String {
    user.chars()
        .take(USER_KEY_LEN)
        .collect::<String>()
        .to_lowercase()
}

fn refilled(bucket: Bucket, policy: Policy, now: Instant) -> f64 {
    let burst = f64::from(policy.burst);
    let rate = burst / policy.refill.as_secs_f64().max(f64::EPSILON);
    let elapsed = now.saturating_duration_since(bucket.updated).as_secs_f64();
    (bucket.tokens + elapsed * rate).min(burst)
}

/// How long until `bucket` holds a whole token again, or `None` when it does now.
fn wait_of(bucket: Option<&Bucket>, policy: Policy, now: Instant) -> Option<Duration> {
    let tokens = refilled(*bucket?, policy, now);
    if tokens >= 1.0 {
        return None;
    }
    let rate = f64::from(policy.burst) / policy.refill.as_secs_f64().max(f64::EPSILON);
    Some(Duration::from_secs_f64((1.0 - tokens) / rate))
}

fn apply<K: Eq + Hash>(
    map: &mut HashMap<K, Bucket>,
    key: K,
    delta: f64,
    policy: Policy,
    now: Instant,
) {
    let burst = f64::from(policy.burst);
    let bucket = map.entry(key).or_insert(Bucket {
        tokens: burst,
        updated: now,
    });
    let tokens = refilled(*bucket, policy, now);
    *bucket = Bucket {
        tokens: (tokens + delta).clamp(0.0, burst),
        updated: now,
    };
    if map.len() > PRUNE_ABOVE {
        map.retain(|_, bucket| refilled(*bucket, policy, now) < burst);
        if map.len() > HARD_LIMIT {
            tracing::warn!(
                buckets = map.len(),
                "Login failure throttle holds too many addresses or users; forgetting them all."
            );
            map.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn ten_failures_a_minute_then_refusals_until_refilled() {
        let throttle = Throttle::new(Policy::default());
        let attacker = ip("203.0.113.7");
        for n in 0..10 {
            assert_eq!(throttle.check(attacker, &format!("user{n}")), Ok(()));
            throttle.failure(attacker, &format!("user{n}"));
        }
        let refused = throttle.check(attacker, "someone").unwrap_err();
        assert_eq!(refused.by, ThrottledBy::Address);
        assert!(refused.retry_after <= Duration::from_secs(6));
        // Another address and the users tried are still fine (one failure each).
        assert_eq!(throttle.check(ip("198.51.100.1"), "user3"), Ok(()));

        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(throttle.check(attacker, "someone").is_err());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(throttle.check(attacker, "someone"), Ok(()));
        throttle.failure(attacker, "someone");
        assert!(throttle.check(attacker, "someone").is_err());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(throttle.check(attacker, "someone"), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_user_name_is_throttled_from_anywhere() {
        let throttle = Throttle::new(Policy {
            burst: 3,
            refill: Duration::from_secs(30),
        });
        for n in 0..3u8 {
            throttle.failure(IpAddr::from([192, 0, 2, n]), "Train1");
        }
        let refused = throttle
            .check(ip("198.51.100.9"), "train1")
            .expect_err("case-insensitive");
        assert_eq!(refused.by, ThrottledBy::User);
        assert_eq!(throttle.check(ip("198.51.100.9"), "train2"), Ok(()));

        throttle.refund(ip("192.0.2.0"), "train1");
        assert_eq!(throttle.check(ip("198.51.100.9"), "train1"), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn refunds_never_exceed_the_burst() {
        let throttle = Throttle::new(Policy {
            burst: 2,
            refill: Duration::from_secs(60),
        });
        let address = ip("192.0.2.1");
        for _ in 0..5 {
            throttle.refund(address, "u");
        }
        throttle.failure(address, "u");
        throttle.failure(address, "u");
        assert!(throttle.check(address, "u").is_err());
    }
}
