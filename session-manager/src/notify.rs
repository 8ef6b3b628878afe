//! Change notification inside the manager: whoever commits something that can change what a
//! node should run (or what a session looks like) says so here, and the long-polls waiting on
//! it wake at once instead of at the next periodic sync or poll.
//!
//! Two kinds of waiters use it: an agent's `GET /v1/agent/desired` (its node's desired state)
//! and a person's long-polls: `GET /v1/sessions/{name}?wait_for=...` (one session's state),
//! `GET /v1/images/{reference}?after=...` (a freeze's state and progress) and
//! `GET /v1/jobs/{id}/logs?wait=true` (a job's output and its end). An agent's sync notifies
//! after it stored everything the agent reported (containers, freeze progress, job output and
//! states), so each report reaches these waiters at once. A waiter subscribes *before* it reads
//! the store, then waits for a [`Changed`] that may concern it and reads again; a notification
//! is only a hint to look again, never the data itself, so an extra one costs one read and a
//! missing one is caught by the agents' periodic, level-triggered sync. Waiters compare what
//! they read with what their caller has (the desired state's version, the session's state, the
//! freeze's progress, the bytes of output), so they answer only on a real difference.
//!
//! One manager process serves the site, so an in-process broadcast is enough.

use ongrid_core::NodeName;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// How many notifications a slow waiter may fall behind before it just looks again.
const BACKLOG: usize = 256;

/// What a commit may have changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changed {
    /// The desired state of this node, or a session placed on it.
    Node(NodeName),
    /// Possibly anything: several nodes, or which node is not known where the commit happens.
    Site,
    /// A session's state, but no node's desired state (a connection opened or closed).
    Sessions,
}

/// The manager's change notifications; cheap to clone.
#[derive(Debug, Clone)]
pub struct Changes {
    events: broadcast::Sender<Changed>,
    shutdown: CancellationToken,
}

impl Changes {
    /// Notifications that stop every waiter when `shutdown` is cancelled, so long-polls do not
    /// hold the manager's graceful shutdown.
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            events: broadcast::channel(BACKLOG).0,
            shutdown,
        }
    }

    /// A commit changed something of `node`'s.
    pub fn node(&self, node: &NodeName) {
        // No waiter: nobody to tell.
        let _ = self.events.send(Changed::Node(node.clone()));
    }

    /// A commit may have changed anything (several nodes, or nodes not known here).
    pub fn site(&self) {
        let _ = self.events.send(Changed::Site);
    }

    /// A commit changed the state of sessions without changing what any node runs.
    pub fn sessions(&self) {
        let _ = self.events.send(Changed::Sessions);
    }

    /// A commit changed something of `node`'s, or of the site when there is no node (a
    /// session that just left its node, for example).
    pub fn node_or_site(&self, node: Option<&NodeName>) {
        match node {
            Some(node) => self.node(node),
            None => self.site(),
        }
    }

    /// A waiter that sees every notification from now on.
    pub fn subscribe(&self) -> Waiter {
        Waiter {
            events: self.events.subscribe(),
            shutdown: self.shutdown.clone(),
        }
    }
}

/// Waits for notifications; made by [`Changes::subscribe`].
#[derive(Debug)]
pub struct Waiter {
    events: broadcast::Receiver<Changed>,
    shutdown: CancellationToken,
}

impl Waiter {
    /// Waits for a notification that may concern `node`'s desired state (any notification when
    /// `None`). `false` when the manager is shutting down.
    pub async fn changed(&mut self, node: Option<&NodeName>) -> bool {
        loop {
            let event = tokio::select! {
                () = self.shutdown.cancelled() => return false,
                event = self.events.recv() => event,
            };
            match event {
                Ok(Changed::Node(changed)) if node.is_some_and(|n| *n != changed) => {}
                Ok(Changed::Sessions) if node.is_some() => {}
                Ok(_) => return true,
                // Fell behind: something may have changed; look again.
                Err(broadcast::error::RecvError::Lagged(_)) => return true,
                Err(broadcast::error::RecvError::Closed) => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    fn node(name: &str) -> NodeName {
        NodeName::parse(name).unwrap()
    }

    #[tokio::test]
    async fn a_waiter_wakes_for_its_node_and_the_site_only() {
        let changes = Changes::new(CancellationToken::new());
        let mut waiter = changes.subscribe();
        changes.node(&node("other"));
        // The notification is there already: one poll sees it and keeps waiting.
        let woke = waiter.changed(Some(&node("mine"))).now_or_never();
        assert_eq!(woke, None, "another node's change does not wake it");
        changes.node(&node("mine"));
        assert!(waiter.changed(Some(&node("mine"))).await);
        changes.site();
        assert!(waiter.changed(Some(&node("mine"))).await);
        changes.sessions();
        let woke = waiter.changed(Some(&node("mine"))).now_or_never();
        assert_eq!(woke, None, "a session's connection does not change a node");
        changes.node(&node("other"));
        assert!(waiter.changed(None).await, "no node: every change wakes it");
        changes.sessions();
        assert!(waiter.changed(None).await);
    }

    #[tokio::test]
    async fn a_notification_before_the_wait_is_not_lost() {
        let changes = Changes::new(CancellationToken::new());
        let mut waiter = changes.subscribe();
        changes.node(&node("mine"));
        assert!(waiter.changed(Some(&node("mine"))).await);
    }

    #[tokio::test]
    async fn a_lagging_waiter_looks_again() {
        let changes = Changes::new(CancellationToken::new());
        let mut waiter = changes.subscribe();
        for _ in 0..BACKLOG + 10 {
            changes.node(&node("other"));
        }
        assert!(waiter.changed(Some(&node("mine"))).await);
    }

    #[tokio::test]
    async fn shutdown_ends_every_wait() {
        let shutdown = CancellationToken::new();
        let changes = Changes::new(shutdown.clone());
        let mut waiter = changes.subscribe();
        let wait = tokio::spawn(async move { waiter.changed(None).await });
        shutdown.cancel();
        assert!(!wait.await.unwrap());
    }
}
