//! Public-key authentication policy: whose key this is (the manager's `authorize`, cached),
//! the login failure throttle, and the allowlist check at authentication. The russh handler
//! (`connection.rs`) calls [`Authenticator::key_owner`] for a key *offer* (which never
//! authenticates) and again after russh verified the signature; only the latter, followed by
//! [`Authenticator::institute_of`], lets a connection in.
//!
//! Answers are cached per key for [`CACHE_TTL`] (an accepted key never past its expiry), so a
//! key that was just added, removed or that expired counts for new connections within a
//! second. The manager is still asked at most once a second per key however many connections
//! use it: concurrent lookups of one key share one call ([`KeyCache::get_or_fetch`]), and a
//! connection's key offer and its signed login are answered by one lookup. Connections already
//! open when a key is removed or expires are closed by `revocations.rs`, which asks the manager
//! about their keys every second.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ongrid_core::api::{KeyCheck, KeyOwner};
use ongrid_core::{normalize_ip, Dn, InstituteName, UserName};
use russh::keys::{HashAlg, PublicKey};
use tokio::time::Instant;

use crate::allowlist::{SharedAllowlist, Verdict};
use crate::manager::GatewayRoutes;
use crate::throttle::{Throttle, ThrottledBy};

/// How long the manager's answer about a key (accepted or refused) is believed without asking
/// again: the longest a removed key keeps opening connections.
pub const CACHE_TTL: Duration = Duration::from_secs(1);
/// The longest a login waits for the manager's answer.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
const CACHE_LIMIT: usize = 10_000;

/// Who a connection authenticated as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub owner: Dn,
    pub user_name: UserName,
    /// `SHA256:...` of the key used.
    pub fingerprint: String,
    /// The SSH user name the client gave: the session it wants.
    pub login: String,
    /// The institute of the source address, checked at authentication.
    pub institute: InstituteName,
}

/// Why a key or a login was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: RefusalKind,
    /// One line for the user, naming the fix.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The manager refused the key (unknown, expired, removed): counts as a failure.
    Key,
    /// Too many failures from this address or for this user name.
    Throttled,
    /// The manager could not be asked: not the user's fault, not counted.
    Unavailable,
    /// The source address is in no institute's allowlist.
    Address,
}

/// The authentication policy shared by all connections.
#[derive(Debug)]
pub struct Authenticator {
    manager: GatewayRoutes,
    cache: KeyCache,
    throttle: Throttle,
    allowlist: Arc<SharedAllowlist>,
}

impl Authenticator {
    pub fn new(
        manager: GatewayRoutes,
        throttle: Throttle,
        allowlist: Arc<SharedAllowlist>,
    ) -> Self {
        Self {
            manager,
            cache: KeyCache::default(),
            throttle,
            allowlist,
        }
    }

    /// Whose `key` is, asking the manager (cached) unless `source` or `login` is throttled.
    /// Logs every refusal with the address. Failures are not counted here: see [`Self::failure`].
    pub async fn key_owner(
        &self,
        source: IpAddr,
        login: &str,
        key: &PublicKey,
    ) -> Result<KeyOwner, Refusal> {
        let source = normalize_ip(source);
        let fingerprint = key.fingerprint(HashAlg::Sha256).to_string();
        if let Err(throttled) = self.throttle.check(source, login) {
            let by = match throttled.by {
                ThrottledBy::Address => format!("from {source}"),
                ThrottledBy::UserAtAddress => format!("for user {login:?} from {source}"),
            };
            tracing::warn!(%source, login, %fingerprint, retry_after_secs = throttled.retry_after.as_secs(), "Login refused: too many failed logins {by}.");
            return Err(Refusal {
                kind: RefusalKind::Throttled,
                message: format!("too many failed logins {by}: wait a minute before trying again"),
            });
        }
        let public_key = match key.to_openssh() {
            Ok(text) => text,
            Err(error) => {
                tracing::warn!(%source, login, %fingerprint, %error, "Login refused: the offered key cannot be encoded.");
                return Err(Refusal {
                    kind: RefusalKind::Key,
                    message: "this key type cannot be used here: use an Ed25519 key".to_owned(),
                });
            }
        };
        let check = KeyCheck {
            public_key: public_key.clone(),
            source,
            login: login.to_owned(),
        };
        let verdict = self
            .cache
            .get_or_fetch(public_key, self.ask_manager(check))
            .await;
        match verdict {
            KeyVerdict::Known(owner) => Ok(owner),
            KeyVerdict::Refused(message) => {
                tracing::info!(%source, login, %fingerprint, reason = ?message, "Key refused.");
                Err(Refusal {
                    kind: RefusalKind::Key,
                    message,
                })
            }
            KeyVerdict::Unavailable(error) => {
                tracing::error!(%source, login, %fingerprint, %error, "Cannot check a key with the manager; login refused.");
                Err(Refusal {
                    kind: RefusalKind::Unavailable,
                    message: "the ongrid manager cannot be reached to check your key: try again in a minute".to_owned(),
                })
            }
        }
    }

    async fn ask_manager(&self, check: KeyCheck) -> KeyVerdict {
        let manager = self.manager.clone();
        // Its own task, so a client that disconnects mid-login never cancels a half-sent call.
        let call = tokio::spawn(async move { manager.authorize(&check).await });
        match tokio::time::timeout(LOOKUP_TIMEOUT, call).await {
            Ok(Ok(Ok(owner))) => KeyVerdict::Known(owner),
            Ok(Ok(Err(error))) => match error.refusal() {
                Some(message) => KeyVerdict::Refused(message.to_owned()),
                None => KeyVerdict::Unavailable(format!("{:#}", anyhow::Error::from(error))),
            },
            Ok(Err(join)) => KeyVerdict::Unavailable(format!("the key check failed: {join}")),
            Err(_) => KeyVerdict::Unavailable(format!(
                "the manager did not answer within {} s",
                LOOKUP_TIMEOUT.as_secs()
            )),
        }
    }

    /// The institute of `source` now, or the refusal (logged) when the allowlist has no place
    /// for it: the second check, at authentication.
    pub fn institute_of(&self, source: IpAddr, login: &str) -> Result<InstituteName, Refusal> {
        let source = normalize_ip(source);
        match self.allowlist.check(source) {
            Verdict::Allowed(institute) => Ok(institute),
            Verdict::Refused => {
                tracing::warn!(%source, login, "Login refused: the address is in no institute's allowlist (any more).");
                Err(Refusal {
                    kind: RefusalKind::Address,
                    message: format!(
                        "connections from {source} are not allowed: ask your site's admins to add your institute's network"
                    ),
                })
            }
            Verdict::NotLoaded => {
                tracing::warn!(%source, login, "Login refused: no allowlist fetched from the manager yet.");
                Err(Refusal {
                    kind: RefusalKind::Unavailable,
                    message: "the gateway is starting: try again in a minute".to_owned(),
                })
            }
        }
    }

    /// Counts one failed login against `source` and `login`.
    pub fn failure(&self, source: IpAddr, login: &str) {
        self.throttle.failure(normalize_ip(source), login);
    }

    /// Gives back a failure counted earlier on a connection that then logged in.
    pub fn refund(&self, source: IpAddr, login: &str) {
        self.throttle.refund(normalize_ip(source), login);
    }
}

/// The manager's answer about one key.
#[derive(Debug, Clone, PartialEq, Eq)]
enum KeyVerdict {
    Known(KeyOwner),
    /// The manager's message, for the user.
    Refused(String),
    /// What went wrong asking, for the log.
    Unavailable(String),
}

/// One key's answer: being fetched (the cell is empty), or fetched at `until`'s time minus
/// [`CACHE_TTL`].
type Slot = Arc<tokio::sync::OnceCell<(KeyVerdict, Instant)>>;

/// Answers per public key (OpenSSH one-line text) with their expiry, and the lookups in flight.
#[derive(Debug, Default)]
struct KeyCache {
    entries: Mutex<HashMap<String, Slot>>,
}

impl KeyCache {
    /// The answer about `key`: the cached one while fresh, else the one `fetch` gives, shared
    /// with every caller asking about `key` meanwhile. `Unavailable` is never remembered.
    async fn get_or_fetch<F>(&self, key: String, fetch: F) -> KeyVerdict
    where
        F: std::future::Future<Output = KeyVerdict>,
    {
        let slot = self.slot(&key, Instant::now());
        let (verdict, _) = slot
            .get_or_init(|| async {
                let verdict = fetch.await;
                (verdict, Instant::now() + CACHE_TTL)
            })
            .await
            .clone();
        if matches!(verdict, KeyVerdict::Unavailable(_)) {
            self.forget(&key, &slot);
        }
        verdict
    }

    /// The slot to read or fill for `key`: the current one while it is in flight or fresh, a
    /// new empty one otherwise.
    fn slot(&self, key: &str, now: Instant) -> Slot {
        let mut entries = self.lock();
        if let Some(slot) = entries.get(key) {
            match slot.get() {
                None => return slot.clone(),
                Some((verdict, until)) if *until > now && !expired(verdict) => return slot.clone(),
                Some(_) => {}
            }
        }
        if entries.len() >= CACHE_LIMIT {
            entries.retain(|_, slot| slot.get().is_none_or(|(_, until)| *until > now));
            if entries.len() >= CACHE_LIMIT {
                entries.clear();
            }
        }
        let slot = Slot::default();
        entries.insert(key.to_owned(), slot.clone());
        slot
    }

    /// Drops `key`'s entry if it is still `slot`.
    fn forget(&self, key: &str, slot: &Slot) {
        let mut entries = self.lock();
        if entries
            .get(key)
            .is_some_and(|current| Arc::ptr_eq(current, slot))
        {
            entries.remove(key);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether an accepted key's own expiry has passed (it is then asked about again).
fn expired(verdict: &KeyVerdict) -> bool {
    matches!(verdict, KeyVerdict::Known(owner) if owner.expires_at <= chrono::Utc::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(expires_in: chrono::Duration) -> KeyOwner {
        KeyOwner {
            owner: Dn::parse("/DC=org/DC=example/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            fingerprint: "SHA256:abc".to_owned(),
            expires_at: chrono::Utc::now() + expires_in,
        }
    }

    fn calls(counter: &std::sync::atomic::AtomicUsize) -> usize {
        counter.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[tokio::test(start_paused = true)]
    async fn answers_are_believed_for_one_second_only() {
        let cache = KeyCache::default();
        let known = KeyVerdict::Known(owner(chrono::Duration::hours(1)));
        let refused = KeyVerdict::Refused("unknown key: run devctl key add".into());
        let ran = std::sync::atomic::AtomicUsize::new(0);
        let fetch = |verdict: KeyVerdict| {
            let ran = &ran;
            async move {
                ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                verdict
            }
        };
        for _ in 0..3 {
            assert_eq!(
                cache.get_or_fetch("k1".into(), fetch(known.clone())).await,
                known
            );
        }
        assert_eq!(calls(&ran), 1);
        tokio::time::advance(CACHE_TTL - Duration::from_millis(1)).await;
        assert_eq!(
            cache
                .get_or_fetch("k1".into(), fetch(refused.clone()))
                .await,
            known,
            "fresh: served from the cache"
        );
        assert_eq!(calls(&ran), 1);
        // The key is removed at the manager: within a second the refusal is what counts.
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            cache
                .get_or_fetch("k1".into(), fetch(refused.clone()))
                .await,
            refused
        );
        assert_eq!(calls(&ran), 2);
        // And a refusal is not remembered longer either (the key was added again).
        tokio::time::advance(CACHE_TTL).await;
        assert_eq!(
            cache.get_or_fetch("k1".into(), fetch(known.clone())).await,
            known
        );
        assert_eq!(calls(&ran), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_to_ask_are_never_remembered() {
        let cache = KeyCache::default();
        let down = KeyVerdict::Unavailable("down".into());
        assert_eq!(
            cache.get_or_fetch("k".into(), async { down.clone() }).await,
            down
        );
        let known = KeyVerdict::Known(owner(chrono::Duration::hours(1)));
        assert_eq!(
            cache
                .get_or_fetch("k".into(), async { known.clone() })
                .await,
            known
        );
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_lookups_of_one_key_share_one_call() {
        let cache = Arc::new(KeyCache::default());
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let answer = Arc::new(tokio::sync::Semaphore::new(0));
        let known = KeyVerdict::Known(owner(chrono::Duration::hours(1)));
        let lookups: Vec<_> = (0..20)
            .map(|_| {
                let (cache, asked, answer, known) =
                    (cache.clone(), asked.clone(), answer.clone(), known.clone());
                tokio::spawn(async move {
                    cache
                        .get_or_fetch("k".into(), async move {
                            asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            let _permit = answer.acquire().await;
                            known
                        })
                        .await
                })
            })
            .collect();
        // Every lookup waits on the one call in flight until the manager answers.
        while calls(&asked) == 0 {
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        answer.add_permits(1);
        for lookup in lookups {
            assert_eq!(lookup.await.unwrap(), known);
        }
        assert_eq!(calls(&asked), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_key_is_never_served_from_the_cache() {
        let cache = KeyCache::default();
        let expired = KeyVerdict::Known(owner(chrono::Duration::seconds(-1)));
        cache
            .get_or_fetch("k".into(), async { expired.clone() })
            .await;
        let refused = KeyVerdict::Refused("expired".into());
        assert_eq!(
            cache
                .get_or_fetch("k".into(), async { refused.clone() })
                .await,
            refused
        );
    }
}
