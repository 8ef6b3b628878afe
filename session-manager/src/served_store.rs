//! Which copy of the store this manager serves ([`ongrid_core::store_identity`]), and what its
//! clients saw. The identity (the store's id and generation, raised by `copy-store` and
//! `mark-restored`) is read at start and again every [`REREAD`], and goes out in the
//! `Ongrid-Store` header of every answer ([`stamp`]); clients refuse a manager that answers
//! from an older generation than one they saw.
//!
//! Clients send the newest identity they saw (`Ongrid-Store-Seen`). When one saw a newer
//! generation of this store than this manager serves, and a fresh read of the database agrees,
//! this manager was left on an old copy after a restore: it says so in an ERROR and is *behind*
//! from then on ([`ServedStore::behind`]), so it no longer leads (its [`crate::replicas::Leader`]
//! answers no, and its loops stop) until it is restarted on the right database. A change of the
//! identity under a running manager (`mark-restored` on the database it serves) is served from
//! the next read on; it needs no step-down, since the leader keeps nothing but the database.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use ongrid_core::store_identity::{StoreIdentity, SEEN_HEADER, STORE_HEADER};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::store::{Store, StoreResult};

/// How often the identity is read again from the database.
pub const REREAD: Duration = Duration::from_secs(5);

/// The identity this manager serves and whether a client showed it is behind.
pub struct ServedStore {
    store: Arc<dyn Store>,
    identity: watch::Sender<StoreIdentity>,
    behind: watch::Sender<bool>,
}

impl ServedStore {
    /// Reads the identity of `store`.
    pub async fn open(store: Arc<dyn Store>) -> StoreResult<Arc<Self>> {
        let identity = store.identity().await?;
        tracing::info!(store = %identity, "Serving this copy of the store.");
        Ok(Arc::new(Self {
            store,
            identity: watch::Sender::new(identity),
            behind: watch::Sender::new(false),
        }))
    }

    /// The identity served now.
    pub fn identity(&self) -> StoreIdentity {
        self.identity.borrow().clone()
    }

    /// `true` from the moment a client showed this manager serves an old copy of its store.
    pub fn behind(&self) -> watch::Receiver<bool> {
        self.behind.subscribe()
    }

    /// Returns once this manager is behind.
    pub async fn left_behind(&self) {
        let mut behind = self.behind.subscribe();
        // The sender lives as long as `self`.
        let _ = behind.wait_for(|behind| *behind).await;
    }

    /// Reads the identity again every [`REREAD`] until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(REREAD) => {}
                () = shutdown.cancelled() => return,
            }
            if let Err(error) = self.reread().await {
                tracing::warn!(%error, "Could not read the store's identity; trying again.");
            }
        }
    }

    /// Reads the identity from the database; the one read.
    async fn reread(&self) -> StoreResult<StoreIdentity> {
        let read = self.store.identity().await?;
        let before = self.identity.send_replace(read.clone());
        if before != read {
            tracing::warn!(before = %before, now = %read, "The store's identity changed under \
                this manager (mark-restored on its database): serving the new one.");
        }
        Ok(read)
    }

    /// A client saw `seen`: when it is a newer generation of this store than the database
    /// holds, this manager is behind.
    async fn client_saw(&self, seen: StoreIdentity) {
        if *self.behind.borrow() {
            return;
        }
        let served = self.identity();
        if seen.id != served.id || seen.generation <= served.generation {
            return;
        }
        // The database may have moved on since the last read.
        let served = match self.reread().await {
            Ok(served) => served,
            Err(error) => {
                tracing::warn!(%error, "Could not read the store's identity to compare it \
                    with a client's.");
                return;
            }
        };
        if seen.id == served.id && seen.generation > served.generation {
            self.behind.send_replace(true);
            tracing::error!(served = %served, seen = %seen, "This manager serves an older copy \
                of the store than its clients saw: its `database` setting was missed after a \
                restore; fix its manager.toml and restart it. It no longer leads, and clients \
                refuse its answers.");
        }
    }
}

/// Middleware: learns from the request what its client saw, and names the store in the answer.
pub async fn stamp(
    State(served): State<Arc<ServedStore>>,
    request: Request,
    next: Next,
) -> Response {
    let seen = request
        .headers()
        .get(SEEN_HEADER)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse::<StoreIdentity>().ok());
    if let Some(seen) = seen {
        served.client_saw(seen).await;
    }
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&served.identity().to_string()) {
        response.headers_mut().insert(STORE_HEADER, value);
    }
    response
}
