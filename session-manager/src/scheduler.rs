//! The scheduling loop: turns the pure [`ongrid_scheduler::plan`] into stored placements.
//!
//! Every `schedule_interval`, and at once when woken (a session was created or removed, an agent
//! registered or synced, a GPU's mode changed), one [`Scheduler::tick`]:
//!
//! 1. sends STARTING sessions whose node went offline back to PENDING ("node N stopped
//!    responding"), keeping their place in the queue. Sessions already running on such a node
//!    are left as they are: the agent's containers keep running without the manager, and the
//!    agent converges again when it is back;
//! 2. builds the [`ongrid_scheduler::SiteState`] from the store and calls `plan`;
//! 3. applies each `Place` action as PENDING → STARTING ("placed on N (GPU-...)") in its own
//!    transaction, which re-checks the state: a session removed meanwhile is skipped.
//!
//! A PENDING session that still has a node is a released one whose stopped container is there:
//! it is pinned to that node while the node is registered and online. When the node is offline
//! or gone the pin is dropped, the session starts anywhere in a new container, and the reason of
//! its placement says so.
//!
//! The time comes from the injected [`Clock`], so tests move time instead of sleeping.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::{NodeName, SessionId, SessionState};
use ongrid_scheduler::Action;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::sessions::{queue, Change};
use crate::site::{pending_session, SiteSnapshot};
use crate::store::{SessionFilter, Store, StoreError, StoreResult};

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Sessions placed (PENDING → STARTING).
    pub placed: usize,
    /// Sessions sent back to the queue because their node stopped responding.
    pub requeued: usize,
}

pub struct Scheduler {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    node_timeout: Duration,
    wake: Arc<Notify>,
    ticks: watch::Sender<u64>,
    /// One tick at a time: two concurrent plans could both hand out the same free GPU.
    tick_lock: tokio::sync::Mutex<()>,
}

impl Scheduler {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        node_timeout: Duration,
        wake: Arc<Notify>,
    ) -> Self {
        Self {
            store,
            clock,
            node_timeout,
            wake,
            ticks: watch::channel(0).0,
            tick_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Counts completed ticks; lets a caller wait for the loop to have run.
    pub fn ticks(&self) -> watch::Receiver<u64> {
        self.ticks.subscribe()
    }

    /// Ticks every `interval` and whenever woken, until `shutdown`.
    pub async fn run(self: Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticker.tick() => {}
                () = self.wake.notified() => {}
            }
            match self.tick(self.clock.now()).await {
                Ok(report) if report != TickReport::default() => {
                    tracing::debug!(
                        placed = report.placed,
                        requeued = report.requeued,
                        "Scheduled."
                    );
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::error!(%error, "Scheduling failed; retrying at the next tick.");
                }
            }
            self.ticks.send_modify(|n| *n += 1);
        }
    }

    /// One round of scheduling at time `now`. Rounds never overlap: the loop and the API
    /// (which schedules a new session at once) take turns.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<TickReport> {
        let _one_at_a_time = self.tick_lock.lock().await;
        let mut report = TickReport::default();
        let site = SiteSnapshot::load(self.store.as_ref(), now, self.node_timeout).await?;
        for node in site.nodes.iter().filter(|n| !site.is_online(n)) {
            let stranded = site.holding.iter().filter(|s| {
                s.state == SessionState::Starting && s.node.as_ref() == Some(&node.name)
            });
            for session in stranded {
                let change = queue::requeue_stranded(&node.name, now);
                if self.apply(session.id, change).await? {
                    tracing::info!(session_id = %session.id, node = %node.name, "Session re-queued: its node stopped responding.");
                    report.requeued += 1;
                }
            }
        }

        let pending = self
            .store
            .sessions(SessionFilter::States(vec![SessionState::Pending]))
            .await?;
        if pending.is_empty() {
            return Ok(report);
        }
        let site = SiteSnapshot::load(self.store.as_ref(), now, self.node_timeout).await?;
        let mut unpinned: HashMap<SessionId, NodeName> = HashMap::new();
        let queue = pending
            .iter()
            .map(|session| {
                let mut queued = pending_session(session);
                if let Some(node) = &session.node {
                    let online = site
                        .nodes
                        .iter()
                        .any(|n| n.name == *node && site.is_online(n));
                    if online {
                        queued.pinned_node = Some(node.clone());
                        queued.previous_gpus = ongrid_core::api::whole_gpus(&session.gpus);
                    } else {
                        unpinned.insert(session.id, node.clone());
                    }
                }
                queued
            })
            .collect();
        let state = site.scheduler_state(queue);
        for action in ongrid_scheduler::plan(&state, now) {
            match action {
                Action::Place {
                    session,
                    node,
                    gpus,
                } => {
                    let change = queue::place(&node, gpus, unpinned.get(&session), now);
                    if self.apply(session, change).await? {
                        tracing::info!(session_id = %session, %node, "Session placed.");
                        report.placed += 1;
                    }
                }
                // The manager passes the plan no batch jobs yet, so it asks for no job action.
                Action::PlaceAfterHalt { .. }
                | Action::HaltJob { .. }
                | Action::StartJob { .. }
                | Action::CancelJob { .. } => {}
            }
        }
        Ok(report)
    }

    /// Stores a change; `false` when the session's state no longer allows it (it was removed
    /// or changed meanwhile), which is not an error for the scheduler.
    async fn apply(&self, id: ongrid_core::SessionId, change: Change) -> StoreResult<bool> {
        match self.store.transition(id, change).await {
            Ok(_) => Ok(true),
            Err(StoreError::InvalidTransition(e)) => {
                tracing::debug!(session_id = %id, error = %e, "Skipping a session that changed meanwhile.");
                Ok(false)
            }
            Err(StoreError::NoSuchSession(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::{TimeDelta, TimeZone};
    use ongrid_core::{
        ComputeCapability, Dn, GpuHealth, GpuId, GpuInfo, GpuRequest, GpuUuid, MemorySize,
        NodeName, SessionId,
    };

    use super::*;
    use crate::clock::ManualClock;
    use crate::domain::sessions::{Placement, SessionRecord};
    use crate::store::{NewSession, NodeRegistration, SqliteStore};

    const TIMEOUT: Duration = Duration::from_secs(30);

    fn t0() -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000, 0).unwrap()
    }

    fn gpu(n: u8) -> GpuInfo {
        GpuInfo {
            uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
            model: "NVIDIA A100-SXM4-40GB".to_owned(),
            capability: ComputeCapability::new(8, 0),
            memory: MemorySize::from_mib(40_960),
            pci_bus_id: None,
            driver_version: None,
            mig_enabled: false,
            health: GpuHealth::Healthy,
            utilization_percent: None,
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        store: Arc<SqliteStore>,
        scheduler: Scheduler,
        owner: Dn,
    }

    async fn fixture(gpus: &[GpuInfo]) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("m.db")).await.unwrap());
        let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
        store.user(&owner, 20_000).await.unwrap();
        let registration = NodeRegistration {
            name: NodeName::parse("node1").unwrap(),
            gpu_backend: "simulated".to_owned(),
            agent_version: "test".to_owned(),
            stream_url: None,
        };
        store.register_node(registration, gpus, t0()).await.unwrap();
        let scheduler = Scheduler::new(
            store.clone(),
            Arc::new(ManualClock::new(t0())),
            TIMEOUT,
            Arc::new(Notify::new()),
        );
        Fixture {
            _dir: dir,
            store,
            scheduler,
            owner,
        }
    }

    async fn create(f: &Fixture, at: DateTime<Utc>) -> SessionRecord {
        f.store
            .create_session(NewSession {
                id: SessionId::new_random(),
                name: None,
                owner: f.owner.clone(),
                request: GpuRequest::default(),
                image: "ongrid/dev:latest".to_owned(),
                at,
                reason: "created".to_owned(),
            })
            .await
            .unwrap()
    }

    async fn state(f: &Fixture, s: &SessionRecord) -> SessionRecord {
        f.store.session(s.id).await.unwrap().unwrap()
    }

    #[tokio::test]
    async fn places_in_queue_order_and_waits_for_a_free_gpu() {
        let f = fixture(&[gpu(1)]).await;
        let first = create(&f, t0()).await;
        let second = create(&f, t0() + TimeDelta::seconds(1)).await;
        let report = f.scheduler.tick(t0()).await.unwrap();
        assert_eq!(report.placed, 1);
        let first = state(&f, &first).await;
        assert_eq!(first.state, SessionState::Starting);
        assert_eq!(
            first.reason,
            "placed on node1 (GPU-11111111-2222-3333-4444-555555555501)"
        );
        assert_eq!(first.gpus, vec![GpuId::Gpu(gpu(1).uuid)]);
        assert_eq!(state(&f, &second).await.state, SessionState::Pending);

        // Nothing changes while the GPU is taken.
        assert_eq!(f.scheduler.tick(t0()).await.unwrap(), TickReport::default());

        f.store
            .transition(
                first.id,
                Change {
                    to: SessionState::Ended,
                    at: t0(),
                    reason: "removed".to_owned(),
                    hold: None,
                    placement: Placement::Keep,
                },
            )
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        assert_eq!(state(&f, &second).await.state, SessionState::Starting);
    }

    #[tokio::test]
    async fn an_offline_node_gets_no_work_and_gives_back_starting_sessions() {
        let f = fixture(&[gpu(1), gpu(2)]).await;
        let running = create(&f, t0()).await;
        let starting = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 2);
        f.store
            .transition(
                running.id,
                Change {
                    to: SessionState::Waiting,
                    at: t0(),
                    reason: "container running on node1".to_owned(),
                    hold: None,
                    placement: Placement::Keep,
                },
            )
            .await
            .unwrap();

        // Still within the timeout: nothing moves.
        let later = t0() + TimeDelta::seconds(30);
        assert_eq!(
            f.scheduler.tick(later).await.unwrap(),
            TickReport::default()
        );

        let gone = t0() + TimeDelta::seconds(31);
        let report = f.scheduler.tick(gone).await.unwrap();
        assert_eq!(
            report,
            TickReport {
                placed: 0,
                requeued: 1
            }
        );
        let starting = state(&f, &starting).await;
        assert_eq!(starting.state, SessionState::Pending);
        assert_eq!(starting.reason, "node node1 stopped responding");
        assert_eq!(starting.node, None);
        assert_eq!(state(&f, &running).await.state, SessionState::Waiting);

        // When the node is back, the session is placed again.
        let node1 = NodeName::parse("node1").unwrap();
        assert!(f
            .store
            .record_sync(&node1, &[gpu(1), gpu(2)], gone)
            .await
            .unwrap());
        assert_eq!(f.scheduler.tick(gone).await.unwrap().placed, 1);
        assert_eq!(state(&f, &starting).await.state, SessionState::Starting);
    }

    #[tokio::test]
    async fn a_released_session_whose_node_is_offline_starts_elsewhere_and_says_so() {
        let f = fixture(&[gpu(1)]).await;
        let session = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        for (to, reason) in [
            (SessionState::Waiting, "container running on node1"),
            (SessionState::Held, "owner: held by alice"),
            (SessionState::Pending, "released by alice"),
        ] {
            let change = Change {
                to,
                at: t0(),
                reason: reason.to_owned(),
                hold: None,
                placement: Placement::Keep,
            };
            f.store.transition(session.id, change).await.unwrap();
        }
        // node1 stops responding; node2 has a free GPU.
        let gone = t0() + TimeDelta::seconds(31);
        let registration = NodeRegistration {
            name: NodeName::parse("node2").unwrap(),
            gpu_backend: "simulated".to_owned(),
            agent_version: "test".to_owned(),
            stream_url: None,
        };
        f.store
            .register_node(registration, &[gpu(2)], gone)
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(gone).await.unwrap().placed, 1);
        let placed = state(&f, &session).await;
        assert_eq!(placed.state, SessionState::Starting);
        assert_eq!(placed.node.as_ref().map(|n| n.as_str()), Some("node2"));
        assert_eq!(
            placed.reason,
            "placed on node2 (GPU-11111111-2222-3333-4444-555555555502); node1, where its held \
             container is, is offline, so it starts in a new container: the old one is removed \
             when node1 is back (the home volume there is kept)"
        );
    }

    #[tokio::test]
    async fn a_released_session_gets_its_old_gpu_back_when_it_is_free() {
        let f = fixture(&[gpu(1), gpu(2)]).await;
        let first = create(&f, t0()).await;
        let second = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 2);
        let old_gpus = state(&f, &second).await.gpus;
        let first_gpus = state(&f, &first).await.gpus;
        assert_ne!(old_gpus, first_gpus);
        let step = |to, reason: &str| Change {
            to,
            at: t0(),
            reason: reason.to_owned(),
            hold: None,
            placement: Placement::Keep,
        };
        for (to, reason) in [
            (SessionState::Waiting, "container running on node1"),
            (SessionState::Held, "owner: held by alice"),
            (SessionState::Pending, "released by alice"),
        ] {
            f.store
                .transition(second.id, step(to, reason))
                .await
                .unwrap();
        }
        // The first session ends: both GPUs are free, and the first one would be chosen for a
        // new session; the released one gets its own back, so its container restarts as it is.
        f.store
            .transition(first.id, step(SessionState::Ended, "removed by alice"))
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        let placed = state(&f, &second).await;
        assert_eq!(placed.state, SessionState::Starting);
        assert_eq!(placed.gpus, old_gpus);
    }

    #[tokio::test]
    async fn the_loop_runs_when_woken() {
        let f = fixture(&[gpu(1)]).await;
        let wake = f.scheduler.wake.clone();
        let mut ticks = f.scheduler.ticks();
        let shutdown = CancellationToken::new();
        let Fixture {
            store, scheduler, ..
        } = f;
        // An interval far longer than the test: only waking can make the second tick happen.
        let task =
            tokio::spawn(Arc::new(scheduler).run(Duration::from_secs(3600), shutdown.clone()));
        ticks.changed().await.unwrap(); // the interval's immediate first tick
        let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
        let session = store
            .create_session(NewSession {
                id: SessionId::new_random(),
                name: None,
                owner,
                request: GpuRequest::default(),
                image: "ongrid/dev:latest".to_owned(),
                at: t0(),
                reason: "created".to_owned(),
            })
            .await
            .unwrap();
        wake.notify_one();
        tokio::time::timeout(Duration::from_secs(10), ticks.changed())
            .await
            .unwrap()
            .unwrap();
        let placed = store.session(session.id).await.unwrap().unwrap();
        assert_eq!(placed.state, SessionState::Starting);
        shutdown.cancel();
        task.await.unwrap();
    }
}
