//! Closing open connections whose key was removed or expired: [`OpenKeys`] knows the key each
//! logged-in connection authenticated with; [`watch`] asks the manager every [`RECHECK`] which
//! of them no longer let their owner in (`POST /v1/gateway/keys/check`) and hands each affected
//! connection the manager's [`RevokedKey`], whose message the connection writes on its session
//! channels' stderr before it disconnects (`connection.rs`).
//!
//! A periodic batched check rather than a push: one small request a second whatever the number
//! of connections, and it covers expiry (which nothing at the manager announces) the same way as
//! removal. While the manager cannot be asked, connections stay open (logged).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ongrid_core::api::{HeldKey, HeldKeys, RevokedKey};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::manager::GatewayRoutes;

/// How often the keys of open connections are checked again: a removed key's connections are
/// closed within about this long.
pub const RECHECK: Duration = Duration::from_secs(1);
/// The longest one check may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys asked about in one request at most (the manager takes up to 10,000).
const CHECK_BATCH: usize = 1000;

/// The key of every logged-in connection, and where to tell it that the key was revoked.
#[derive(Debug, Default)]
pub struct OpenKeys {
    connections: Mutex<HashMap<uuid::Uuid, Watched>>,
}

#[derive(Debug)]
struct Watched {
    key: HeldKey,
    revoked: oneshot::Sender<RevokedKey>,
}

/// A connection's place in [`OpenKeys`], given up when dropped.
#[derive(Debug)]
pub struct Registration {
    keys: Arc<OpenKeys>,
    connection: uuid::Uuid,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.keys.lock().remove(&self.connection);
    }
}

impl OpenKeys {
    /// Watches `key` for `connection`: the receiver gets the revocation, at most once.
    pub fn register(
        self: &Arc<Self>,
        connection: uuid::Uuid,
        key: HeldKey,
    ) -> (Registration, oneshot::Receiver<RevokedKey>) {
        let (revoked, receiver) = oneshot::channel();
        self.lock().insert(connection, Watched { key, revoked });
        let registration = Registration {
            keys: self.clone(),
            connection,
        };
        (registration, receiver)
    }

    /// The distinct keys held now.
    pub fn held(&self) -> Vec<HeldKey> {
        let keys: HashSet<HeldKey> = self.lock().values().map(|w| w.key.clone()).collect();
        keys.into_iter().collect()
    }

    /// Tells every connection holding one of `revoked` (they leave the watch); returns how many.
    pub fn revoke(&self, revoked: &[RevokedKey]) -> usize {
        let by_key: HashMap<&HeldKey, &RevokedKey> = revoked.iter().map(|r| (&r.key, r)).collect();
        let mut connections = self.lock();
        let hit: Vec<uuid::Uuid> = connections
            .iter()
            .filter(|(_, w)| by_key.contains_key(&w.key))
            .map(|(id, _)| *id)
            .collect();
        for id in &hit {
            if let Some(watched) = connections.remove(id) {
                if let Some(revocation) = by_key.get(&watched.key) {
                    let _ = watched.revoked.send((*revocation).clone());
                }
            }
        }
        hit.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<uuid::Uuid, Watched>> {
        self.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Checks the open connections' keys every `every` until `shutdown`.
pub async fn watch(
    manager: GatewayRoutes,
    keys: Arc<OpenKeys>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = shutdown.cancelled() => return,
        }
        for batch in keys.held().chunks(CHECK_BATCH) {
            let request = HeldKeys {
                keys: batch.to_vec(),
            };
            let answer = tokio::time::timeout(CHECK_TIMEOUT, manager.check_keys(&request)).await;
            let error = match answer {
                Ok(Ok(answer)) => {
                    if failing {
                        tracing::info!("The manager checks open connections' keys again.");
                        failing = false;
                    }
                    if !answer.revoked.is_empty() {
                        let closed = keys.revoke(&answer.revoked);
                        tracing::info!(
                            keys = answer.revoked.len(),
                            connections = closed,
                            "Keys of open connections were removed or expired: closing those connections."
                        );
                    }
                    continue;
                }
                Ok(Err(error)) => format!("{:#}", anyhow::Error::from(error)),
                Err(_) => format!(
                    "the manager did not answer within {} s",
                    CHECK_TIMEOUT.as_secs()
                ),
            };
            if !failing {
                tracing::warn!(keys = batch.len(), %error, "Cannot check open connections' keys with the manager; they stay open meanwhile.");
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::api::Revocation;
    use ongrid_core::Dn;

    use super::*;

    fn key(fingerprint: &str, owner: &str) -> HeldKey {
        HeldKey {
            fingerprint: fingerprint.to_owned(),
            owner: Dn::parse(owner).unwrap(),
        }
    }

    #[test]
    fn a_revocation_reaches_exactly_the_connections_of_that_key() {
        let keys = Arc::new(OpenKeys::default());
        let alice = key("SHA256:a", "/CN=Alice");
        let bob = key("SHA256:b", "/CN=Bob");
        let (a1, mut a1_revoked) = keys.register(uuid::Uuid::new_v4(), alice.clone());
        let (_a2, mut a2_revoked) = keys.register(uuid::Uuid::new_v4(), alice.clone());
        let (_b, mut b_revoked) = keys.register(uuid::Uuid::new_v4(), bob.clone());
        let mut held = keys.held();
        held.sort_by(|x, y| x.fingerprint.cmp(&y.fingerprint));
        assert_eq!(held, vec![alice.clone(), bob.clone()]);

        drop(a1);
        let revoked = RevokedKey {
            key: alice.clone(),
            why: Revocation::Removed,
            at: chrono::Utc::now(),
            message: "your SSH key SHA256:a was removed".to_owned(),
        };
        assert_eq!(keys.revoke(std::slice::from_ref(&revoked)), 1);
        assert_eq!(a2_revoked.try_recv().unwrap(), revoked);
        assert!(a1_revoked.try_recv().is_err(), "gone before the revocation");
        assert!(b_revoked.try_recv().is_err(), "another key is untouched");
        assert_eq!(keys.held(), vec![bob]);
    }
}
