//! Public-key authentication policy: whose key this is (the manager's `authorize`, cached),
//! the login failure throttle, and the allowlist check at authentication. The russh handler
//! (`connection.rs`) calls [`Authenticator::key_owner`] for a key *offer* (which never
//! authenticates) and again after russh verified the signature; only the latter, followed by
//! [`Authenticator::institute_of`], lets a connection in.
//!
//! Answers are cached per key: an accepted key for [`ACCEPTED_TTL`] (never past its expiry), a
//! refused one for [`REFUSED_TTL`] only, so a key that was just added works within seconds and
//! a removed or expired one stops working within half a minute.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ongrid_core::api::{KeyCheck, KeyOwner};
use ongrid_core::{normalize_ip, Dn, InstituteName, UserName};
use russh::keys::{HashAlg, PublicKey};
use tokio::time::Instant;

use crate::allowlist::{SharedAllowlist, Verdict};
use crate::manager::ManagerClient;
use crate::throttle::{Throttle, ThrottledBy};

/// How long an accepted key is believed without asking the manager again.
pub const ACCEPTED_TTL: Duration = Duration::from_secs(30);
/// How long a refusal is remembered (short: a user who just ran `devctl key add` retries).
pub const REFUSED_TTL: Duration = Duration::from_secs(3);
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
    manager: ManagerClient,
    cache: KeyCache,
    throttle: Throttle,
    allowlist: Arc<SharedAllowlist>,
}

impl Authenticator {
    pub fn new(
        manager: ManagerClient,
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
                ThrottledBy::User => format!("for user {login:?}"),
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
        let now = Instant::now();
        let verdict = match self.cache.get(&public_key, now) {
            Some(verdict) => verdict,
            None => {
                let check = KeyCheck {
                    public_key: public_key.clone(),
                    source,
                    login: login.to_owned(),
                };
                let verdict = self.ask_manager(check).await;
                self.cache.insert(public_key, &verdict, Instant::now());
                verdict
            }
        };
        match verdict {
            KeyVerdict::Known(owner) => Ok(owner),
            KeyVerdict::Refused(message) => {
                tracing::info!(%source, login, %fingerprint, reason = %message, "Key refused.");
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

/// Answers per public key (OpenSSH one-line text), with their expiry.
#[derive(Debug, Default)]
struct KeyCache {
    entries: Mutex<HashMap<String, (KeyVerdict, Instant)>>,
}

impl KeyCache {
    fn get(&self, key: &str, now: Instant) -> Option<KeyVerdict> {
        let entries = self.lock();
        let (verdict, until) = entries.get(key)?;
        if *until <= now {
            return None;
        }
        if let KeyVerdict::Known(owner) = verdict {
            if owner.expires_at <= chrono::Utc::now() {
                return None;
            }
        }
        Some(verdict.clone())
    }

    /// Remembers `verdict` for its time to live; `Unavailable` is never remembered.
    fn insert(&self, key: String, verdict: &KeyVerdict, now: Instant) {
        let ttl = match verdict {
            KeyVerdict::Known(_) => ACCEPTED_TTL,
            KeyVerdict::Refused(_) => REFUSED_TTL,
            KeyVerdict::Unavailable(_) => return,
        };
        let mut entries = self.lock();
        if entries.len() >= CACHE_LIMIT {
            entries.retain(|_, (_, until)| *until > now);
            if entries.len() >= CACHE_LIMIT {
                entries.clear();
            }
        }
        entries.insert(key, (verdict.clone(), now + ttl));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (KeyVerdict, Instant)>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
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

    #[tokio::test(start_paused = true)]
    async fn accepted_keys_are_cached_longer_than_refusals() {
        let cache = KeyCache::default();
        let known = KeyVerdict::Known(owner(chrono::Duration::hours(1)));
        cache.insert("ssh-ed25519 AAAA1".into(), &known, Instant::now());
        cache.insert(
            "ssh-ed25519 AAAA2".into(),
            &KeyVerdict::Refused("unknown key: run devctl key add".into()),
            Instant::now(),
        );
        cache.insert(
            "ssh-ed25519 AAAA3".into(),
            &KeyVerdict::Unavailable("down".into()),
            Instant::now(),
        );
        assert_eq!(
            cache.get("ssh-ed25519 AAAA1", Instant::now()),
            Some(known.clone())
        );
        assert!(cache.get("ssh-ed25519 AAAA2", Instant::now()).is_some());
        assert_eq!(cache.get("ssh-ed25519 AAAA3", Instant::now()), None);

        tokio::time::advance(REFUSED_TTL).await;
        assert_eq!(cache.get("ssh-ed25519 AAAA2", Instant::now()), None);
        assert!(cache.get("ssh-ed25519 AAAA1", Instant::now()).is_some());
        tokio::time::advance(ACCEPTED_TTL - REFUSED_TTL).await;
        assert_eq!(cache.get("ssh-ed25519 AAAA1", Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_key_is_never_served_from_the_cache() {
        let cache = KeyCache::default();
        let expired = KeyVerdict::Known(owner(chrono::Duration::seconds(-1)));
        cache.insert("k".into(), &expired, Instant::now());
        assert_eq!(cache.get("k", Instant::now()), None);
    }
}
