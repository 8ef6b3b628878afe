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
//! Within one manager an in-process broadcast carries them to the waiters that want every
//! notification (people's long-polls); an agent's long-poll waits on its own node's signal and
//! the site's ([`Changes::subscribe_node`]), so a change of one node wakes one agent's poll, not
//! the thousand others of a large site. Several replicas on one PostgreSQL
//! database ([`crate::replicas`]) also tell each other: every notification made here is queued
//! for the other replicas ([`Changes::with_outbox`], published with PostgreSQL's NOTIFY as a
//! [`Remote`] payload), and what the others publish is delivered here with [`Changes::deliver`],
//! so an agent's long-poll on one replica wakes for a placement another one made.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ongrid_core::NodeName;
use tokio::sync::{broadcast, mpsc, watch};
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

/// How many notifications may wait to be published to the other replicas; beyond it they are
/// folded into one [`Changed::Site`].
pub const OUTBOX: usize = 1024;

/// The manager's change notifications; cheap to clone.
#[derive(Debug, Clone)]
pub struct Changes {
    events: broadcast::Sender<Changed>,
    /// What wakes the waiters of one node: each node's signal, and the site's.
    nodes: Arc<NodeSignals>,
    shutdown: CancellationToken,
    /// To the other replicas (PostgreSQL only).
    outbox: Option<Outbox>,
    /// The rounds this manager's requests asked for, and how far a leader's rounds covered them
    /// (see [`Changes::ask_round`]).
    rounds: Arc<Rounds>,
}

/// How many rounds the requests asked for, and the highest of those numbers a leader's round
/// has covered.
#[derive(Debug)]
struct Rounds {
    asked: AtomicU64,
    covered: watch::Sender<u64>,
}

/// A signal per node whose changes someone waits on, and one for [`Changed::Site`]. A watch
/// marks each receiver's place, so a signal sent between a waiter's subscription and its wait
/// is not lost, and any number of them reads as one (the waiter looks again once).
///
/// Each signal holds the number of the last notification it carried, counted across all of
/// them (`sent`), so where a waiter's two signals stand ([`Position`]) moves with every
/// notification that concerns its node, even one sent while nobody held the node's signal: a
/// signal made again starts at the count, past every number sent before.
#[derive(Debug)]
struct NodeSignals {
    site: watch::Sender<u64>,
    nodes: Mutex<Signals>,
    sent: AtomicU64,
}

#[derive(Debug, Default)]
struct Signals {
    by_node: HashMap<NodeName, watch::Sender<u64>>,
    /// The count at which the signals nobody waits on are let go (twice the count after the
    /// last time), so the map stays the size of the nodes polling.
    prune_at: usize,
}

impl NodeSignals {
    /// The signals (a holder that panicked left the map whole: nothing in it panics midway).
    fn signals(&self) -> std::sync::MutexGuard<'_, Signals> {
        self.nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next notification's number.
    fn number(&self) -> u64 {
        self.sent.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn node(&self, node: &NodeName) {
        let number = self.number();
        if let Some(signal) = self.signals().by_node.get(node) {
            raise(signal, number);
        }
    }

    fn site(&self) {
        raise(&self.site, self.number());
    }

    fn subscribe(&self, node: &NodeName) -> watch::Receiver<u64> {
        let mut signals = self.signals();
        if let Some(signal) = signals.by_node.get(node) {
            return signal.subscribe();
        }
        if signals.by_node.len() >= signals.prune_at {
            signals
                .by_node
                .retain(|_, signal| signal.receiver_count() > 0);
            signals.prune_at = (2 * signals.by_node.len()).max(64);
        }
        let (signal, receiver) = watch::channel(self.sent.load(Ordering::SeqCst));
        signals.by_node.insert(node.clone(), signal);
        receiver
    }
}

/// Moves `signal` to `number` unless it stands past it already: a notification numbered before
/// a signal was made again (at the count) may reach it after a later one, and a signal never
/// goes back, so a [`Position`] is never one that an earlier read was made at.
fn raise(signal: &watch::Sender<u64>, number: u64) {
    signal.send_if_modified(|last| {
        let newer = number > *last;
        if newer {
            *last = number;
        }
        newer
    });
}

/// The queue of notifications for the other replicas, and whether some did not fit in it.
#[derive(Debug, Clone)]
struct Outbox {
    queue: mpsc::Sender<Changed>,
    overflowed: Arc<AtomicBool>,
}

/// What one replica tells the others, as the text of a PostgreSQL notification:
/// `<replica> node <name>`, `<replica> site`, `<replica> sessions`, `<replica> wake <n>`,
/// `<replica> covered <replica> <n>` or `<replica> leading`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remote {
    Changed(Changed),
    /// Something the leader's loops act on (a new request, a release, a drain): run a round.
    /// The number is how many rounds the sender's requests had asked for when it sent this
    /// ([`Changes::ask_round`]); 0 from a replica that does not count them (`<replica> wake`).
    Wake(u64),
    /// The leader's answer to a [`Remote::Wake`]: a round that started after it came has ended,
    /// so whatever `replica` had committed before asking for round `asked` is placed, or waits.
    Covered {
        replica: String,
        asked: u64,
    },
    /// The sender has just taken the lead. A follower whose requests still wait for a round
    /// asks again: a wake sent while no replica led (the leader died, or had not started yet)
    /// was heard by nobody, and its requests would otherwise answer PENDING at the end of
    /// their `placement_wait` and stay so until the next loop round.
    Leading,
}

impl Remote {
    /// The notification's text, from replica `from`.
    pub fn encode(&self, from: &str) -> String {
        match self {
            Self::Changed(Changed::Node(node)) => format!("{from} node {node}"),
            Self::Changed(Changed::Site) => format!("{from} site"),
            Self::Changed(Changed::Sessions) => format!("{from} sessions"),
            Self::Wake(asked) => format!("{from} wake {asked}"),
            Self::Covered { replica, asked } => format!("{from} covered {replica} {asked}"),
            Self::Leading => format!("{from} leading"),
        }
    }

    /// The replica that sent `payload` and what it said; `None` for a text no replica sends.
    pub fn decode(payload: &str) -> Option<(&str, Self)> {
        let mut words = payload.split(' ');
        let from = words.next().filter(|w| !w.is_empty())?;
        let remote = match (words.next()?, words.next(), words.next()) {
            ("node", Some(node), None) => Self::Changed(Changed::Node(NodeName::parse(node).ok()?)),
            ("site", None, None) => Self::Changed(Changed::Site),
            ("sessions", None, None) => Self::Changed(Changed::Sessions),
            ("wake", None, None) => Self::Wake(0),
            ("wake", Some(asked), None) => Self::Wake(asked.parse().ok()?),
            ("covered", Some(replica), Some(asked)) => Self::Covered {
                replica: replica.to_owned(),
                asked: asked.parse().ok()?,
            },
            ("leading", None, None) => Self::Leading,
            _ => return None,
        };
        words.next().is_none().then_some((from, remote))
    }
}

impl Changes {
    /// Notifications that stop every waiter when `shutdown` is cancelled, so long-polls do not
    /// hold the manager's graceful shutdown.
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            events: broadcast::channel(BACKLOG).0,
            nodes: Arc::new(NodeSignals {
                site: watch::channel(0).0,
                nodes: Mutex::default(),
                sent: AtomicU64::new(0),
            }),
            shutdown,
            outbox: None,
            rounds: Arc::new(Rounds {
                asked: AtomicU64::new(0),
                covered: watch::channel(0).0,
            }),
        }
    }

    /// A request that committed something asks for a round that starts after the commit: the
    /// number to wait for ([`Self::covered`]). On a follower the wake that follows carries it,
    /// or a higher one, to the leader ([`Self::rounds_asked`]); a leader covers it with its own
    /// round.
    pub fn ask_round(&self) -> u64 {
        self.rounds.asked.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// How many rounds this replica's requests have asked for.
    pub fn rounds_asked(&self) -> u64 {
        self.rounds.asked.load(Ordering::SeqCst)
    }

    /// Whether a request of this replica still waits for a round that covers it.
    pub fn awaits_round(&self) -> bool {
        self.rounds_asked() > *self.rounds.covered.borrow()
    }

    /// The leader said its round covered what was asked up to `asked`.
    pub fn round_covered(&self, asked: u64) {
        self.rounds.covered.send_if_modified(|covered| {
            let later = asked > *covered;
            if later {
                *covered = asked;
            }
            later
        });
    }

    /// Waits until a leader's round covered round `asked` (or shutdown).
    pub async fn covered(&self, asked: u64) {
        let mut covered = self.rounds.covered.subscribe();
        tokio::select! {
            _ = covered.wait_for(|covered| *covered >= asked) => {}
            () = self.shutdown.cancelled() => {}
        }
    }

    /// Also queues every notification for the other replicas; the receiver publishes them
    /// ([`Changes::take_overflow`] says when some did not fit).
    pub fn with_outbox(mut self) -> (Self, mpsc::Receiver<Changed>) {
        let (queue, queued) = mpsc::channel(OUTBOX);
        self.outbox = Some(Outbox {
            queue,
            overflowed: Arc::new(AtomicBool::new(false)),
        });
        (self, queued)
    }

    /// Whether notifications were left out of the outbox since the last call (the publisher then
    /// tells the others [`Changed::Site`]).
    pub fn take_overflow(&self) -> bool {
        self.outbox
            .as_ref()
            .is_some_and(|outbox| outbox.overflowed.swap(false, Ordering::Relaxed))
    }

    fn send(&self, changed: Changed) {
        if let Some(outbox) = &self.outbox {
            if outbox.queue.try_send(changed.clone()).is_err() {
                outbox.overflowed.store(true, Ordering::Relaxed);
            }
        }
        self.deliver(changed);
    }

    /// Wakes the waiters of this manager only: for what another replica committed.
    pub fn deliver(&self, changed: Changed) {
        match &changed {
            Changed::Node(node) => self.nodes.node(node),
            Changed::Site => self.nodes.site(),
            Changed::Sessions => {}
        }
        // No waiter: nobody to tell.
        let _ = self.events.send(changed);
    }

    /// A commit changed something of `node`'s.
    pub fn node(&self, node: &NodeName) {
        self.send(Changed::Node(node.clone()));
    }

    /// A commit may have changed anything (several nodes, or nodes not known here).
    pub fn site(&self) {
        self.send(Changed::Site);
    }

    /// A commit changed the state of sessions without changing what any node runs.
    pub fn sessions(&self) {
        self.send(Changed::Sessions);
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
            wakes: Wakes::Every(self.events.subscribe()),
            shutdown: self.shutdown.clone(),
        }
    }

    /// A waiter that sees, from now on, the notifications that may concern `node`'s desired
    /// state: its own and the site's.
    pub fn subscribe_node(&self, node: &NodeName) -> Waiter {
        Waiter {
            wakes: Wakes::Node {
                node: self.nodes.subscribe(node),
                site: self.nodes.site.subscribe(),
            },
            shutdown: self.shutdown.clone(),
        }
    }
}

/// Waits for notifications; made by [`Changes::subscribe`] or [`Changes::subscribe_node`].
#[derive(Debug)]
pub struct Waiter {
    wakes: Wakes,
    shutdown: CancellationToken,
}

#[derive(Debug)]
enum Wakes {
    Every(broadcast::Receiver<Changed>),
    Node {
        node: watch::Receiver<u64>,
        site: watch::Receiver<u64>,
    },
}

/// Where a node waiter's signals stood ([`Waiter::position`]): what was read of the node after
/// it is still what is stored as long as the position has not moved, for every commit that
/// could change it notifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    node: u64,
    site: u64,
}

impl Waiter {
    /// Where the node's signals stand now; `None` for a waiter of every notification.
    pub fn position(&self) -> Option<Position> {
        match &self.wakes {
            Wakes::Every(_) => None,
            Wakes::Node { node, site } => Some(Position {
                node: *node.borrow(),
                site: *site.borrow(),
            }),
        }
    }

    /// A long-poll on one record: `value` as first read, read again with `read` after each
    /// notification the waiter sees until `settled` holds, `deadline` passes, the manager shuts down or the record is gone
    /// (`read` answers `None`); the last value read.
    pub async fn follow<T, E, Fut>(
        &mut self,
        deadline: tokio::time::Instant,
        mut value: T,
        settled: impl Fn(&T) -> bool,
        mut read: impl FnMut() -> Fut,
    ) -> Result<T, E>
    where
        Fut: std::future::Future<Output = Result<Option<T>, E>>,
    {
        while !settled(&value)
            && matches!(
                tokio::time::timeout_at(deadline, self.changed()).await,
                Ok(true)
            )
        {
            match read().await? {
                Some(now) => value = now,
                None => break,
            }
        }
        Ok(value)
    }

    /// Waits for the next notification this waiter sees. `false` when the manager is shutting
    /// down.
    pub async fn changed(&mut self) -> bool {
        let woke = async {
            match &mut self.wakes {
                // Fell behind (`Lagged`): something may have changed; look again.
                Wakes::Every(events) => !matches!(
                    events.recv().await,
                    Err(broadcast::error::RecvError::Closed)
                ),
                Wakes::Node { node, site } => tokio::select! {
                    changed = node.changed() => changed.is_ok(),
                    changed = site.changed() => changed.is_ok(),
                },
            }
        };
        tokio::select! {
            () = self.shutdown.cancelled() => false,
            woke = woke => woke,
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
    async fn a_node_waiter_wakes_for_its_node_and_the_site_only() {
        let changes = Changes::new(CancellationToken::new());
        let mut mine = changes.subscribe_node(&node("mine"));
        let mut every = changes.subscribe();
        changes.node(&node("other"));
        // The notification is there already: one poll sees it and keeps waiting.
        let woke = mine.changed().now_or_never();
        assert_eq!(woke, None, "another node's change does not wake it");
        changes.node(&node("mine"));
        assert_eq!(mine.changed().now_or_never(), Some(true));
        assert_eq!(mine.changed().now_or_never(), None, "seen once");
        changes.site();
        assert_eq!(mine.changed().now_or_never(), Some(true));
        changes.sessions();
        let woke = mine.changed().now_or_never();
        assert_eq!(woke, None, "a session's connection does not change a node");
        // Replicas' notifications wake it as the manager's own do.
        changes.deliver(Changed::Node(node("mine")));
        assert_eq!(mine.changed().now_or_never(), Some(true));
        // A waiter of every notification saw each of them.
        for _ in 0..5 {
            assert_eq!(every.changed().now_or_never(), Some(true));
        }
        assert_eq!(every.changed().now_or_never(), None);
    }

    /// A node waiter's position moves with each notification of its node or the site, also one
    /// sent while nobody held the node's signal, and with nothing else.
    #[test]
    fn a_node_waiters_position_moves_with_what_concerns_its_node() {
        let changes = Changes::new(CancellationToken::new());
        let first = changes.subscribe_node(&node("mine")).position().unwrap();
        changes.node(&node("other"));
        changes.sessions();
        let waiter = changes.subscribe_node(&node("mine"));
        assert_eq!(waiter.position(), Some(first), "nothing of its node");
        changes.node(&node("mine"));
        let second = waiter.position().unwrap();
        assert_ne!(second, first);
        changes.site();
        let third = waiter.position().unwrap();
        assert_ne!(third, second);
        // Nobody holds the node's signal: it is let go once many others are made, and a
        // notification for the node meanwhile still moves the position of the next waiter.
        drop(waiter);
        for n in 0..200 {
            drop(changes.subscribe_node(&node(&format!("gone-{n}"))));
        }
        assert!(!changes.nodes.signals().by_node.contains_key(&node("mine")));
        changes.node(&node("mine"));
        let after = changes.subscribe_node(&node("mine")).position().unwrap();
        assert_ne!(after, third, "changed while nobody waited");
        assert_eq!(changes.subscribe().position(), None);
    }

    #[tokio::test]
    async fn a_notification_before_the_wait_is_not_lost() {
        let changes = Changes::new(CancellationToken::new());
        let mut waiter = changes.subscribe();
        let mut mine = changes.subscribe_node(&node("mine"));
        changes.node(&node("mine"));
        assert!(waiter.changed().await);
        assert!(mine.changed().await);
    }

    #[tokio::test]
    async fn a_lagging_waiter_looks_again() {
        let changes = Changes::new(CancellationToken::new());
        let mut waiter = changes.subscribe();
        for _ in 0..BACKLOG + 10 {
            changes.node(&node("other"));
        }
        assert!(waiter.changed().await);
    }

    /// Signals nobody waits on are let go as others are made, and a node polling again gets a
    /// signal that works.
    #[tokio::test]
    async fn the_signals_of_nodes_nobody_waits_on_are_let_go() {
        let changes = Changes::new(CancellationToken::new());
        for n in 0..1000 {
            drop(changes.subscribe_node(&node(&format!("gone-{n}"))));
        }
        let mut kept = changes.subscribe_node(&node("kept"));
        let held = changes.nodes.signals().by_node.len();
        assert!(held <= 64, "{held} signals held for 1 waiter");
        drop(changes.subscribe_node(&node("gone-1")));
        let mut again = changes.subscribe_node(&node("gone-1"));
        changes.node(&node("gone-1"));
        assert_eq!(again.changed().now_or_never(), Some(true));
        assert_eq!(kept.changed().now_or_never(), None);
        changes.node(&node("kept"));
        assert_eq!(kept.changed().now_or_never(), Some(true));
    }

    #[test]
    fn what_a_replica_says_reads_back_the_same() {
        for remote in [
            Remote::Changed(Changed::Node(node("gpu-7"))),
            Remote::Changed(Changed::Site),
            Remote::Changed(Changed::Sessions),
            Remote::Wake(7),
            Remote::Covered {
                replica: "r2".to_owned(),
                asked: 7,
            },
            Remote::Leading,
        ] {
            let text = remote.encode("r1");
            assert_eq!(Remote::decode(&text), Some(("r1", remote)), "{text}");
        }
        // A replica that does not count its rounds.
        assert_eq!(Remote::decode("r1 wake"), Some(("r1", Remote::Wake(0))));
        for text in [
            "",
            "r1",
            "r1 node",
            "r1 nodes x",
            "r1 site x",
            " site",
            "r1 wake x",
            "r1 wake 1 2",
            "r1 covered r2",
            "r1 covered r2 -1",
            "r1 leading now",
        ] {
            assert_eq!(Remote::decode(text), None, "{text:?}");
        }
    }

    #[tokio::test]
    async fn a_request_waits_for_the_round_that_covers_it() {
        let changes = Changes::new(CancellationToken::new());
        let (first, second) = (changes.ask_round(), changes.ask_round());
        assert_eq!((first, second, changes.rounds_asked()), (1, 2, 2));
        assert_eq!(changes.covered(first).now_or_never(), None);
        assert!(changes.awaits_round());
        changes.round_covered(first);
        assert_eq!(changes.covered(first).now_or_never(), Some(()));
        assert_eq!(changes.covered(second).now_or_never(), None, "not yet");
        assert!(changes.awaits_round(), "the second still waits");
        // An answer that comes late changes nothing.
        changes.round_covered(2);
        changes.round_covered(1);
        assert_eq!(changes.covered(second).now_or_never(), Some(()));
        assert!(!changes.awaits_round());
    }

    #[tokio::test]
    async fn the_outbox_gets_every_notification_and_says_when_it_overflowed() {
        let (changes, mut outbox) = Changes::new(CancellationToken::new()).with_outbox();
        let mut waiter = changes.subscribe();
        changes.node(&node("mine"));
        assert_eq!(outbox.recv().await, Some(Changed::Node(node("mine"))));
        assert!(waiter.changed().await);
        changes.deliver(Changed::Site);
        assert!(waiter.changed().await, "delivered here");
        assert!(outbox.try_recv().is_err(), "not published again");
        for _ in 0..OUTBOX + 1 {
            changes.sessions();
        }
        assert!(changes.take_overflow());
        assert!(!changes.take_overflow());
    }

    #[tokio::test]
    async fn shutdown_ends_every_wait() {
        let shutdown = CancellationToken::new();
        let changes = Changes::new(shutdown.clone());
        let mut waiter = changes.subscribe();
        let mut node_waiter = changes.subscribe_node(&node("mine"));
        let wait = tokio::spawn(async move { waiter.changed().await });
        let node_wait = tokio::spawn(async move { node_waiter.changed().await });
        shutdown.cancel();
        assert!(!wait.await.unwrap());
        assert!(!node_wait.await.unwrap());
    }
}
