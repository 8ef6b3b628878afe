//! The hold timer: applies the hold policy ([`crate::domain::sessions::holds`]) to the running
//! sessions. It wakes at the earliest planned hold (and at least every [`MAX_SLEEP`]), recomputes
//! everything from the store and applies the holds that are due, each once: after a manager
//! restart an overdue hold is applied at once, at the current time, its reason saying when it
//! was due.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::{SessionId, SessionState};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::sessions::holds::{evaluate, LifecycleConfig, LifecycleFacts};
use crate::notify::Changes;
use crate::store::{FactsScope, Store, StoreError, StoreResult};

/// The timer looks at the sessions at least this often, whatever the deadlines.
pub const MAX_SLEEP: Duration = Duration::from_secs(2);

/// What one [`HoldTimer::tick`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldReport {
    /// Sessions held, with the reason stored.
    pub held: Vec<(SessionId, HoldReason)>,
    /// The earliest hold still planned.
    pub next: Option<DateTime<Utc>>,
}

/// Applies the policy's holds. One per manager, run by [`HoldTimer::run`].
pub struct HoldTimer {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    config: LifecycleConfig,
    /// Woken when a hold frees GPUs, so the scheduler places waiting sessions at once.
    scheduler_wake: Arc<Notify>,
    ticks: watch::Sender<u64>,
    /// Told of every hold, so the session's agent stops its container at once.
    changes: Option<Changes>,
}

impl HoldTimer {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        config: LifecycleConfig,
        scheduler_wake: Arc<Notify>,
    ) -> Self {
        Self {
            store,
            clock,
            config,
            scheduler_wake,
            ticks: watch::channel(0).0,
            changes: None,
        }
    }

    /// Notifies `changes` of every hold it applies.
    pub fn with_changes(mut self, changes: Changes) -> Self {
        self.changes = Some(changes);
        self
    }

    /// Counts completed ticks; lets a caller wait for the timer to have run.
    pub fn ticks(&self) -> watch::Receiver<u64> {
        self.ticks.subscribe()
    }

    /// Ticks until `shutdown`: at once (applying holds that fell due while the manager was not
    /// running), then at the earliest planned hold, and at least every [`MAX_SLEEP`].
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let now = self.clock.now();
            let sleep = match self.tick(now).await {
                Ok(report) => {
                    let until_next = report
                        .next
                        .and_then(|next| (next - now).to_std().ok())
                        .unwrap_or(MAX_SLEEP);
                    until_next.clamp(Duration::from_millis(50), MAX_SLEEP)
                }
                Err(error) => {
                    tracing::error!(%error, "Applying session holds failed; retrying.");
                    MAX_SLEEP
                }
            };
            self.ticks.send_modify(|n| *n += 1);
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(sleep) => {}
            }
        }
    }

    /// Looks at every running session at `now` and holds those whose hold is due.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<HoldReport> {
        let running = vec![
            SessionState::Waiting,
            SessionState::Connected,
            SessionState::Idle,
        ];
        let snapshot = self
            .store
            .lifecycle_facts(FactsScope::States(running))
            .await?;
        self.apply(snapshot, now).await
    }

    /// Holds the sessions of `snapshot` whose hold is due at `now`. The store decides each
    /// again on its facts as they are when the hold is written: a connection opened, a
    /// keep-alive or activity recorded since the snapshot was read cancels it.
    async fn apply(
        &self,
        snapshot: Vec<LifecycleFacts>,
        now: DateTime<Utc>,
    ) -> StoreResult<HoldReport> {
        let mut report = HoldReport::default();
        for facts in snapshot {
            let Some(planned) = evaluate(&facts, &self.config, now).next else {
                continue;
            };
            if planned.hold.at > now {
                report.next = Some(match report.next {
                    Some(next) => next.min(planned.hold.at),
                    None => planned.hold.at,
                });
                continue;
            }
            match self
                .store
                .hold_if_due(facts.session_id, &self.config, now)
                .await
            {
                Ok(Some((session, reason))) => {
                    tracing::info!(session_id = %session.id, session = %session.name,
                        user = %session.user_name, reason = %session.reason, "Session held.");
                    if let Some(changes) = &self.changes {
                        changes.node_or_site(session.node.as_ref());
                    }
                    crate::metrics::events().held(reason);
                    report.held.push((facts.session_id, reason));
                }
                // Changed meanwhile (a connection, a keep-alive; removed, held by hand): the
                // next tick plans again from what is stored.
                Ok(None) => {}
                Err(StoreError::InvalidTransition(_) | StoreError::NoSuchSession(_)) => {}
                Err(other) => return Err(other),
            }
        }
        if !report.held.is_empty() {
            self.scheduler_wake.notify_one();
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use chrono::{TimeDelta, TimeZone};
    use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
    use ongrid_core::holds::{ContainerActivity, SignalKind};
    use ongrid_core::{Dn, GpuRequest, InstituteName, NodeName};

    use super::*;
    use crate::clock::ManualClock;
    use crate::domain::sessions::holds::view;
    use crate::domain::sessions::{Change, Placement, SessionRecord};
    use crate::store::{fixtures, SqliteStore};

    fn t0() -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000, 0).unwrap()
    }

    fn at(secs: i64) -> DateTime<Utc> {
        t0() + TimeDelta::seconds(secs)
    }

    fn config() -> LifecycleConfig {
        LifecycleConfig::default()
    }

    async fn open(dir: &tempfile::TempDir) -> Arc<SqliteStore> {
        Arc::new(SqliteStore::open(&dir.path().join("m.db")).await.unwrap())
    }

    fn timer(store: &Arc<SqliteStore>) -> HoldTimer {
        timer_with(store, config())
    }

    fn timer_with(store: &Arc<SqliteStore>, config: LifecycleConfig) -> HoldTimer {
        HoldTimer::new(
            store.clone(),
            Arc::new(ManualClock::new(t0())),
            config,
            Arc::new(Notify::new()),
        )
    }

    /// What the store knows of session `id`'s lifecycle.
    async fn session_facts(store: &SqliteStore, id: SessionId) -> Vec<LifecycleFacts> {
        store
            .lifecycle_facts(FactsScope::Session(id))
            .await
            .unwrap()
    }

    /// A site that set `open_connection_keeps_alive`.
    fn connections_keep_alive() -> LifecycleConfig {
        LifecycleConfig {
            open_connection_keeps_alive: true,
            ..config()
        }
    }

    /// A session on node1 that became ready (WAITING) at t0.
    async fn running(store: &SqliteStore) -> SessionRecord {
        let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
        store.user(&owner, 20_000).await.unwrap();
        let node1 = fixtures::registration("node1");
        let node = node1.name.clone();
        store.register_node(node1, &[], at(-10)).await.unwrap();
        let new = fixtures::new_session(&owner, at(-10));
        let session = store.create_session(new).await.unwrap();
        let place = Placement::Place {
            node,
            gpus: Vec::new(),
        };
        let starting = Change {
            placement: place,
            ..Change::keep_placement(SessionState::Starting, at(-5), "test")
        };
        store.transition(session.id, starting).await.unwrap();
        let ready = Change::keep_placement(SessionState::Waiting, t0(), "test");
        store.transition(session.id, ready).await.unwrap()
    }

    fn event(
        session: &SessionRecord,
        kind: ConnectionEventKind,
        id: uuid::Uuid,
        bytes: u64,
    ) -> ConnectionEvent {
        ConnectionEvent {
            connection_id: id,
            event: kind,
            at: t0(),
            owner: session.owner.clone(),
            fingerprint: "SHA256:x".to_owned(),
            source: "192.0.2.7".parse().unwrap(),
            institute: InstituteName::parse("uni-x").unwrap(),
            session_id: session.id,
            bytes_in: bytes,
            bytes_out: 0,
            close_reason: None,
        }
    }

    #[tokio::test]
    async fn a_due_hold_is_applied_once_and_frees_the_session() {
        let (_dir, store) = fixtures::sqlite().await;
        let session = running(&store).await;
        let timer = timer(&store);
        let report = timer.tick(at(1199)).await.unwrap();
        assert_eq!(report.held, []);
        assert_eq!(report.next, Some(at(1200)));
        let report = timer.tick(at(1200)).await.unwrap();
        assert_eq!(report.held, [(session.id, HoldReason::NoConnection)]);
        let held = store.session(session.id).await.unwrap().unwrap();
        assert_eq!(held.state, SessionState::Held);
        assert!(
            held.reason
                .starts_with("no-connection: nobody connected within 20 minutes"),
            "{}",
            held.reason
        );
        assert_eq!(timer.tick(at(1300)).await.unwrap(), HoldReport::default());
    }

    #[tokio::test]
    async fn a_connection_or_keep_between_the_look_and_the_hold_cancels_it() {
        let (_dir, store) = fixtures::sqlite().await;
        let timer = timer(&store);
        let running_states = || {
            FactsScope::States(vec![
                SessionState::Waiting,
                SessionState::Connected,
                SessionState::Idle,
            ])
        };
        // The timer has read the facts (the hold is due) when the user connects.
        let connected = running(&store).await;
        let snapshot = store.lifecycle_facts(running_states()).await.unwrap();
        let open = event(
            &connected,
            ConnectionEventKind::Open,
            uuid::Uuid::new_v4(),
            0,
        );
        store.record_connection(&open, at(1200)).await.unwrap();
        let report = timer.apply(snapshot, at(1200)).await.unwrap();
        assert_eq!(report.held, []);
        let session = store.session(connected.id).await.unwrap().unwrap();
        assert_eq!(session.state, SessionState::Connected);

        // ... or keeps it alive with `devctl session keep`.
        let kept = running(&store).await;
        let snapshot = session_facts(&store, kept.id).await;
        store.set_keep_until(kept.id, at(3600)).await.unwrap();
        let report = timer.apply(snapshot, at(1200)).await.unwrap();
        assert_eq!(report.held, []);
        let session = store.session(kept.id).await.unwrap().unwrap();
        assert_eq!(session.state, SessionState::Waiting);
        // Nothing changed: held.
        let snapshot = session_facts(&store, kept.id).await;
        let report = timer.apply(snapshot, at(3600)).await.unwrap();
        assert_eq!(report.held, [(kept.id, HoldReason::NoConnection)]);
    }

    /// A database of the release before the lifecycle (migrations 0001-0003) with a session
    /// someone has been connected to for years: the upgrade does not hold it.
    #[tokio::test]
    async fn an_upgrade_keeps_sessions_with_open_connections() {
        let dir = tempfile::tempdir().unwrap();
        let migrator = fixtures::migrations_before("migrations", "0004", dir.path()).await;
        let file = dir.path().join("m.db");
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&file)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        migrator.run(&pool).await.unwrap();
        let ts = |secs: i64| at(secs).to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
        let id = SessionId::new_random();
        let request = serde_json::to_string(&GpuRequest::default()).unwrap();
        let statements = [
            format!(
                "INSERT INTO users VALUES ('/DC=org/CN=Alice', 'alice', 20000, '{}')",
                ts(0)
            ),
            format!(
                "INSERT INTO nodes (name, gpu_backend, agent_version, registered_at, \
                 last_seen) VALUES ('node1', 'simulated', 'old', '{0}', '{0}')",
                ts(0)
            ),
            format!(
                "INSERT INTO sessions VALUES ('{id}', 'dev', '/DC=org/CN=Alice', \
                 '{request}', 'ongrid/dev:latest', 'CONNECTED', 'SSH connection', 'node1', \
                 '[]', '{0}', '{0}', NULL)",
                ts(0)
            ),
            format!(
                "INSERT INTO session_transitions VALUES ('{id}', 0, NULL, 'PENDING', '{}', \
                 'created'), ('{id}', 1, 'PENDING', 'STARTING', '{}', 'placed'), \
                 ('{id}', 2, 'STARTING', 'WAITING', '{}', 'running'), \
                 ('{id}', 3, 'WAITING', 'CONNECTED', '{}', 'SSH connection')",
                ts(0),
                ts(1),
                ts(10),
                ts(60)
            ),
            format!(
                "INSERT INTO connections (id, owner, fingerprint, source, institute, \
                 session_id, opened_at) VALUES ('{}', '/DC=org/CN=Alice', 'SHA256:x', \
                 '192.0.2.7', 'uni-x', '{id}', '{}')",
                uuid::Uuid::new_v4(),
                ts(60)
            ),
        ];
        for statement in statements {
            sqlx::query(&statement).execute(&pool).await.unwrap();
        }
        pool.close().await;

        let store = open(&dir).await;
        let now = Utc::now();
        let facts = session_facts(&store, id).await;
        assert_eq!(facts[0].live_connections(&config(), now), 1);
        let report = timer_with(&store, connections_keep_alive())
            .tick(now)
            .await
            .unwrap();
        assert_eq!(report.held, []);
        let session = store.session(id).await.unwrap().unwrap();
        assert_eq!(session.state, SessionState::Connected);
    }

    #[tokio::test]
    async fn an_overdue_hold_is_applied_once_after_a_restart() {
        let (dir, store) = fixtures::sqlite().await;
        let session = running(&store).await;
        assert_eq!(
            timer(&store).tick(at(600)).await.unwrap().next,
            Some(at(1200))
        );
        // The manager stops mid-countdown and comes back long after the deadline.
        store.close().await;
        drop(store);
        let store = open(&dir).await;
        let timer = timer(&store);
        let report = timer.tick(at(5000)).await.unwrap();
        assert_eq!(report.held, [(session.id, HoldReason::NoConnection)]);
        let transitions = store.transitions(session.id).await.unwrap();
        let hold = transitions.last().unwrap();
        assert_eq!(hold.at, at(5000), "applied at the time it is applied");
        assert!(
            hold.reason.ends_with("(due at 2023-11-14 22:33:20 UTC)"),
            "{}",
            hold.reason
        );
        assert_eq!(timer.tick(at(5001)).await.unwrap(), HoldReport::default());
        let holds = store
            .transitions(session.id)
            .await
            .unwrap()
            .iter()
            .filter(|t| t.to == SessionState::Held)
            .count();
        assert_eq!(holds, 1);
    }

    #[tokio::test]
    async fn stored_signals_drive_the_idle_hold() {
        let (_dir, store) = fixtures::sqlite().await;
        let session = running(&store).await;
        let timer = timer(&store);
        let connection = uuid::Uuid::new_v4();
        let open = event(&session, ConnectionEventKind::Open, connection, 0);
        store.record_connection(&open, at(100)).await.unwrap();
        // Connected, but an open connection is no activity: idle 2 hours after it became ready.
        let report = timer.tick(at(200)).await.unwrap();
        assert_eq!(report.next, Some(at(7200)));
        // Output alone is not activity.
        let output = ConnectionEvent {
            bytes_out: 4096,
            ..event(&session, ConnectionEventKind::Activity, connection, 0)
        };
        store.record_connection(&output, at(300)).await.unwrap();
        assert_eq!(timer.tick(at(300)).await.unwrap().next, Some(at(7200)));
        // The client sent bytes: traffic at 400.
        let activity = event(&session, ConnectionEventKind::Activity, connection, 10);
        store.record_connection(&activity, at(400)).await.unwrap();
        let close = event(&session, ConnectionEventKind::Close, connection, 10);
        let closed = store.record_connection(&close, at(500)).await.unwrap();
        assert_eq!(closed.session.state, SessionState::Idle);
        assert_eq!(
            timer.tick(at(600)).await.unwrap().next,
            Some(at(500 + 7200))
        );
        // A busy process after the disconnect keeps it; an idle one does not.
        let node = NodeName::parse("node1").unwrap();
        let sample = |cpu: f64| ContainerActivity {
            session_id: session.id,
            sampled_at: t0(),
            cpu_percent: cpu,
            gpu_percent: Some(0.0),
        };
        let lifecycle = config();
        let other = NodeName::parse("node2").unwrap();
        // Busy, then idle, then a sample from a node that is not the session's: not recorded.
        for (from, cpu, seen, recorded) in [
            (&node, 97.0, 3000, 1),
            (&node, 0.5, 3100, 1),
            (&other, 99.0, 3200, 0),
        ] {
            let samples = [sample(cpu)];
            let stored = store.record_activity(from, &samples, at(seen), &lifecycle);
            assert_eq!(stored.await.unwrap(), recorded, "{from} at {seen}");
        }
        assert_eq!(
            timer.tick(at(3100)).await.unwrap().next,
            Some(at(3000 + 7200))
        );
        let facts = session_facts(&store, session.id).await;
        let view = view(&facts[0], &config(), at(3100));
        assert_eq!(view.kept_alive_by, Some(SignalKind::Cpu));
        assert_eq!(view.signals[1].last_seen, Some(at(400)), "SSH traffic");
        assert_eq!(
            view.signals[3].detail.as_deref(),
            Some("last sample 0% GPU at 2023-11-14 23:05:00 UTC (threshold 5%)")
        );
        let report = timer.tick(at(10_200)).await.unwrap();
        assert_eq!(report.held, [(session.id, HoldReason::Idle)]);
    }

    #[tokio::test]
    async fn a_gateway_that_vanished_does_not_keep_a_session() {
        let (_dir, store) = fixtures::sqlite().await;
        let session = running(&store).await;
        let timer = timer_with(&store, connections_keep_alive());
        let open = event(&session, ConnectionEventKind::Open, uuid::Uuid::new_v4(), 0);
        store.record_connection(&open, at(100)).await.unwrap();
        // No close, no reports: stale after 3 minutes, idle 2 hours after its last report.
        assert_eq!(
            timer.tick(at(280)).await.unwrap().next,
            Some(at(7 * 86_400))
        );
        assert_eq!(
            timer.tick(at(281)).await.unwrap().next,
            Some(at(100 + 7200))
        );
        let report = timer.tick(at(100 + 7200)).await.unwrap();
        assert_eq!(report.held, [(session.id, HoldReason::Idle)]);
    }

    #[tokio::test]
    async fn a_release_requeues_pinned_and_restarts_the_countdown() {
        let (_dir, store) = fixtures::sqlite().await;
        let session = running(&store).await;
        store.set_keep_until(session.id, at(50)).await.unwrap();
        timer(&store).tick(at(1200)).await.unwrap();
        let release = Change::keep_placement(SessionState::Pending, at(2000), "released");
        let released = store.transition(session.id, release).await.unwrap();
        assert_eq!(
            released.node.as_ref().map(|n| n.as_str()),
            Some("node1"),
            "pinned"
        );
        assert_eq!(
            released.gpus, session.gpus,
            "the held container's GPUs are kept so the scheduler can give them back"
        );
        assert_eq!(released.queued_at, at(2000), "the end of the queue");
        let facts = session_facts(&store, session.id).await;
        assert_eq!(facts[0].keep_until, None);
        assert_eq!(facts[0].ready_at, None);
        assert_eq!(facts[0].first_started_at, Some(t0()));
        for (to, t) in [
            (SessionState::Starting, 2001),
            (SessionState::Waiting, 2010),
        ] {
            let change = Change::keep_placement(to, at(t), "test");
            store.transition(session.id, change).await.unwrap();
        }
        let facts = session_facts(&store, session.id).await;
        assert_eq!(facts[0].ready_at, Some(at(2010)), "ready again");
        assert_eq!(
            facts[0].first_started_at,
            Some(t0()),
            "max-duration still counts from the first start"
        );
        assert_eq!(
            timer(&store).tick(at(2010)).await.unwrap().next,
            Some(at(2010 + 1200))
        );
    }
}
