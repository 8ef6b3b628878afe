//! Throttling of failed logins, per source address and per (source address, SSH user name): a
//! token bucket each (by default 20 failures per address and 10 per user name at an address,
//! each refilled in a minute). While either bucket of an attempt is empty the attempt is
//! refused at once, without asking the manager, and not counted.
//!
//! There is deliberately no bucket per user name alone: it would be shared by all addresses,
//! so anyone could lock a user out by failing logins under the user's name from elsewhere.
//! Guessing gets nowhere anyway (only registered keys with their signature log in); what the
//! buckets bound is the load one address puts on the manager. The address bucket is the larger
//! one because an institute's users may share one NAT address. Time is tokio's clock, so
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

/// The policies of the two kinds of bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policies {
    /// Failures from one source address, whatever the user name.
    pub address: Policy,
    /// Failures for one user name from one source address.
    pub user_at_address: Policy,
}

impl Default for Policies {
    /// 20 failures per address (one more every 3 s), 10 per user name at an address (one more
    /// every 6 s).
    fn default() -> Self {
        Self {
            address: Policy {
                burst: 20,
                refill: Duration::from_secs(60),
            },
            user_at_address: Policy {
                burst: 10,
                refill: Duration::from_secs(60),
            },
        }
    }
}

/// Which bucket refused an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThrottledBy {
    /// The source address, whatever the user name.
    Address,
    /// This user name from this source address.
    UserAtAddress,
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
    policies: Policies,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    addresses: HashMap<IpAddr, Bucket>,
    users_at_addresses: HashMap<(IpAddr, String), Bucket>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Throttle {
    pub fn new(policies: Policies) -> Self {
        Self {
            policies,
            state: Mutex::new(State::default()),
        }
    }

    /// `Err` when the address, or the user name at this address, has no failure left to spend.
    pub fn check(&self, address: IpAddr, user: &str) -> Result<(), Throttled> {
        let now = Instant::now();
        let policies = self.policies;
        let state = self.lock();
        let address_wait = wait_of(state.addresses.get(&address), policies.address, now);
        let user_wait = wait_of(
            state.users_at_addresses.get(&(address, user_key(user))),
            policies.user_at_address,
            now,
        );
        drop(state);
        match (address_wait, user_wait) {
            (Some(retry_after), _) => Err(Throttled {
                by: ThrottledBy::Address,
                retry_after,
            }),
            (None, Some(retry_after)) => Err(Throttled {
                by: ThrottledBy::UserAtAddress,
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
        let policies = self.policies;
        let mut state = self.lock();
        let State {
            addresses,
            users_at_addresses,
        } = &mut *state;
        apply(addresses, address, delta, policies.address, now);
        apply(
            users_at_addresses,
            (address, user_key(user)),
            delta,
            policies.user_at_address,
            now,
        );
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

    fn policies(address: u32, user_at_address: u32) -> Policies {
        Policies {
            address: Policy {
                burst: address,
                refill: Duration::from_secs(60),
            },
            user_at_address: Policy {
                burst: user_at_address,
                refill: Duration::from_secs(60),
            },
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_address_is_throttled_whatever_the_user_names_until_refilled() {
        let throttle = Throttle::new(policies(10, 10));
        let attacker = ip("203.0.113.7");
        for n in 0..10 {
            assert_eq!(throttle.check(attacker, &format!("user{n}")), Ok(()));
            throttle.failure(attacker, &format!("user{n}"));
        }
        let refused = throttle.check(attacker, "someone").unwrap_err();
        assert_eq!(refused.by, ThrottledBy::Address);
        assert!(refused.retry_after <= Duration::from_secs(6));
        // Another address and the users tried are still fine.
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
    async fn a_user_name_is_throttled_per_address_so_nobody_locks_its_owner_out() {
        let throttle = Throttle::new(policies(20, 3));
        // Failures under train1's name from many addresses, each within its allowance...
        for n in 0..50u8 {
            let address = IpAddr::from([192, 0, 2, n]);
            for _ in 0..2 {
                assert_eq!(throttle.check(address, "Train1"), Ok(()));
                throttle.failure(address, "Train1");
            }
        }
        // ...never refuse the owner at their own address.
        assert_eq!(throttle.check(ip("198.51.100.9"), "train1"), Ok(()));

        // From one address, a name runs out before the address does; other names go on.
        let address = ip("192.0.2.200");
        for _ in 0..3 {
            throttle.failure(address, "train1");
        }
        let refused = throttle
            .check(address, "TRAIN1")
            .expect_err("case-insensitive");
        assert_eq!(refused.by, ThrottledBy::UserAtAddress);
        assert_eq!(throttle.check(address, "train2"), Ok(()));
        assert_eq!(throttle.check(ip("192.0.2.201"), "train1"), Ok(()));

        throttle.refund(address, "train1");
        assert_eq!(throttle.check(address, "train1"), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn refunds_never_exceed_the_burst() {
        let throttle = Throttle::new(policies(2, 2));
        let address = ip("192.0.2.1");
        for _ in 0..5 {
            throttle.refund(address, "u");
        }
        throttle.failure(address, "u");
        throttle.failure(address, "u");
        assert!(throttle.check(address, "u").is_err());
    }
}
