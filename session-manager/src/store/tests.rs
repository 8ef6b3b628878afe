//! The store's tests, each run against both backends: a SQLite file in a temporary directory
//! and a fresh database on a real PostgreSQL server ([`super::test_server`]). Both must behave
//! the same; a test listed in [`backend_tests!`] runs as `store::tests::sqlite::<name>` and
//! `store::tests::postgres::<name>`.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;

use chrono::{DateTime, TimeZone, Utc};
use ongrid_core::image::ImageState;
use ongrid_core::{
    ComputeCapability, Dn, GpuHealth, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid, NodeName,
    SessionId, SessionName, SessionState, Sharing,
};

use super::fixtures::{self, gpu, registration};
use super::*;
use crate::domain::sessions::{Change, Placement, SessionRecord};

/// Which store a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Sqlite,
    #[cfg(feature = "postgres")]
    Postgres,
}

/// Where a test's store lives, so that it can be opened again (a manager restart).
pub(crate) struct Place {
    /// The SQLite file's directory (also made for PostgreSQL, for files a test writes).
    pub(crate) dir: tempfile::TempDir,
    pub(crate) database: Database,
}

impl Place {
    pub(crate) async fn new(backend: Backend) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let database = match backend {
            Backend::Sqlite => Database::Sqlite(dir.path().join("manager.db")),
            #[cfg(feature = "postgres")]
            Backend::Postgres => Database::Postgres(super::test_server::fresh_database().await),
        };
        Self { dir, database }
    }

    /// A new place and its store, opened.
    async fn opened(backend: Backend) -> (Self, TestStore) {
        let place = Self::new(backend).await;
        let store = place.open().await;
        (place, store)
    }

    /// The schema of an older release (the migrations numbered below `version`) and
    /// `statements` run on it, for a test of the upgrade from it: [`Self::open`] then migrates.
    async fn old_schema_with(&self, version: &str, statements: &[String]) {
        let migrations = match &self.database {
            Database::Sqlite(_) => "migrations",
            #[cfg(feature = "postgres")]
            Database::Postgres(_) => "migrations-postgres",
        };
        let migrator = fixtures::migrations_before(migrations, version, self.dir.path()).await;
        // Through either backend's pool, whose types differ.
        macro_rules! fill {
            ($pool:expr) => {{
                let pool = $pool;
                migrator.run(&pool).await.unwrap();
                for statement in statements {
                    sqlx::query(statement).execute(&pool).await.unwrap();
                }
                pool.close().await;
            }};
        }
        match &self.database {
            Database::Sqlite(file) => fill!(sqlx::SqlitePool::connect_with(
                sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(file)
                    .create_if_missing(true)
            )
            .await
            .unwrap()),
            #[cfg(feature = "postgres")]
            Database::Postgres(url) => fill!(sqlx::PgPool::connect(url).await.unwrap()),
        }
    }

    pub(crate) async fn open(&self) -> TestStore {
        TestStore(
            self.database
                .open()
                .await
                .unwrap_or_else(|e| panic!("opening {}: {e}", self.database)),
        )
    }
}

/// An open store of either backend, used as a `dyn Store`.
#[derive(Clone)]
pub(crate) struct TestStore(OpenedStore);

impl Deref for TestStore {
    type Target = dyn Store;

    fn deref(&self) -> &Self::Target {
        match &self.0 {
            OpenedStore::Sqlite(store) => store,
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => store,
        }
    }
}

impl TestStore {
    /// Holds the turn of the store's writes made together of `kind`: none is written until the
    /// guard is dropped.
    async fn hold(&self, kind: Together) -> tokio::sync::OwnedMutexGuard<()> {
        match &self.0 {
            OpenedStore::Sqlite(store) => store.hold_together(kind).await,
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => store.hold_together(kind).await,
        }
    }

    /// Whether a write of `kind` is under way or waits for the site's write lock.
    fn turn_taken(&self, kind: Together) -> bool {
        match &self.0 {
            OpenedStore::Sqlite(store) => store.turn_taken(kind),
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => store.turn_taken(kind),
        }
    }

    /// Holds the site's write lock until the returned value is dropped.
    async fn hold_write_lock(&self) -> Box<dyn std::any::Any + Send> {
        match &self.0 {
            OpenedStore::Sqlite(store) => Box::new(store.hold_write_lock().await),
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => Box::new(store.hold_write_lock().await),
        }
    }

    /// How many jobs a node's jobs took from the kept copy, and how many they did not find
    /// there as their rows said.
    fn kept_jobs_found(&self) -> (u64, u64) {
        match &self.0 {
            OpenedStore::Sqlite(store) => store.kept_jobs_found(),
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => store.kept_jobs_found(),
        }
    }

    /// The name of the thread a write made together runs on.
    async fn thread_of_writes(&self) -> Option<String> {
        match &self.0 {
            OpenedStore::Sqlite(store) => store.thread_of_writes().await,
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => store.thread_of_writes().await,
        }
    }

    /// How many writes of `kind` wait to be made together.
    fn waiting(&self, kind: Together) -> usize {
        match &self.0 {
            OpenedStore::Sqlite(store) => store.waiting_together(kind),
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => store.waiting_together(kind),
        }
    }

    pub(crate) async fn close(&self) {
        self.0.close().await;
    }

    /// Runs `sql` (written with `?` for each argument in order) and returns every row's
    /// columns as text, so that tests can look at what is stored: cast what is not text.
    pub(crate) async fn rows(&self, sql: &str, args: &[&str]) -> Vec<Vec<Option<String>>> {
        use sqlx::Row;
        // `$1, $2, ...` for the `?`s: numbered parameters, which both databases take.
        let numbered: String = sql
            .split('?')
            .enumerate()
            .map(|(n, part)| match n {
                0 => part.to_owned(),
                n => format!("${n}{part}"),
            })
            .collect();
        // The same statement on either backend's pool, whose types differ.
        macro_rules! text_rows {
            ($pool:expr) => {{
                let mut query = sqlx::query(&numbered);
                for arg in args {
                    query = query.bind(*arg);
                }
                let rows = query.fetch_all($pool).await.unwrap();
                rows.iter()
                    .map(|row| (0..row.len()).map(|i| row.get(i)).collect())
                    .collect()
            }};
        }
        match &self.0 {
            OpenedStore::Sqlite(store) => text_rows!(store.pool()),
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => text_rows!(store.pool()),
        }
    }
}

/// Runs each listed `async fn name(backend: Backend)` once per backend.
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Backend::Sqlite).await;
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Backend::Postgres).await;
                }
            )*
        }
    };
}

backend_tests!(
    a_reopened_file_gives_everything_back,
    the_active_jobs_follow_every_change_of_a_job,
    a_nodes_jobs_are_as_stored_whatever_the_kept_copy_has_seen,
    transitions_go_through_the_lifecycle,
    names_are_unique_per_owner_among_sessions_that_have_not_ended,
    creates_written_together_each_keep_their_own_answer,
    creates_that_come_while_a_write_waits_for_the_lock_go_in_it,
    writes_made_together_run_on_the_thread_of_the_writes,
    submits_written_together_each_keep_their_own_answer,
    heartbeats_written_together_each_keep_their_own_answer,
    activity_samples_written_together_each_keep_their_own_answer,
    activity_samples_are_written_when_the_hold_policy_must_see_them,
    users_get_stable_unique_names_and_uids,
    request_reservations_are_those_of_sessions_not_ended,
    nodes_keep_gpu_modes_and_mark_vanished_gpus_failed,
    the_queue_is_ordered_by_time_then_id,
    concurrent_writers_do_not_fail,
    concurrent_placements_of_one_session_store_one,
    keys_belong_to_one_owner_and_renew,
    institutes_keep_their_networks,
    connections_coming_and_going_leave_a_bounded_history,
    connections_are_audited_and_move_their_session,
    nodes_keep_their_stream_url,
    an_upgrade_types_the_hold_reasons_already_stored,
    a_hold_is_stored_typed_and_read_as_its_sentence,
    a_dashboard_link_is_used_once_and_not_after_it_expired,
    a_restart_chain_is_stored_with_its_history_and_links,
    job_changes_stored_together_skip_the_refused_ones,
    job_changes_of_callers_waiting_together_share_one_write,
    job_logs_of_callers_waiting_together_keep_the_later_record,
    sync_records_of_every_kind_waiting_together_are_written_together,
    a_sync_record_that_cannot_be_written_fails_alone,
    a_job_change_stored_together_with_others_creates_the_next_job_of_its_chain,
    ended_jobs_are_removed_with_what_refers_to_them_and_never_sooner,
    closed_connections_are_pruned_and_open_ones_kept,
    a_store_keeps_its_identity_and_a_restore_raises_its_generation,
    a_new_gpu_starts_in_the_mode_its_agent_asks_and_a_known_one_keeps_its_own,
    token_identities_link_to_existing_users_and_keys_keep_their_token_issuer,
    sessions_and_jobs_are_counted_by_state,
    an_upgrade_counts_the_sessions_and_jobs_already_stored,
    changes_stored_together_skip_the_refused_ones,
    changes_stored_together_each_set_their_own_session,
    session_and_job_changes_of_callers_waiting_together_share_one_write,
    a_rounds_placements_and_job_changes_are_stored_in_one_write,
    the_planning_read_follows_every_change_of_the_gpus_made_through_any_store,
    the_planning_read_of_sessions_follows_every_write_made_through_any_store,
    a_session_is_created_with_its_own_lifecycle_limits,
    a_node_resumes_the_starting_sessions_that_ran_before,
    a_nodes_images_are_those_building_there_and_those_removed_since,
    a_nodes_desired_state_reads_its_work_on_one_connection_as_alone,
);

/// What a node's desired state names of the images, in one read: those BUILDING on it (its
/// freeze orders), and those DELETED since the given time on any node (their Docker images
/// leave every node); not another node's BUILDING ones, nor ones deleted before. Its desired
/// state's read ([`Store::desired_reads`]) finds the same, none included.
async fn a_nodes_images_are_those_building_there_and_those_removed_since(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1)], t(0)).await;
    register(&store, "node2", &[gpu(2)], t(0)).await;
    register(&store, "node3", &[gpu(3)], t(0)).await;
    let node1 = NodeName::parse("node1").unwrap();
    let node2 = NodeName::parse("node2").unwrap();
    let node3 = NodeName::parse("node3").unwrap();
    let mut images = Vec::new();
    for (n, node) in [
        (1, &node1),
        (2, &node2),
        (3, &node1),
        (4, &node2),
        (5, &node1),
    ] {
        let session = create(&store, &alice.dn, Some(&format!("s{n}")), t(1)).await;
        let image = freeze_order(&store, &session, node, &format!("img{n}:v1")).await;
        images.push(image.id);
    }
    // The third (node1's) deleted before the cut, the fourth (node2's) after it, the fifth
    // (node1's) failed: no longer BUILDING, not DELETED.
    store.delete_image(images[2], t(20)).await.unwrap().unwrap();
    let failed = crate::domain::images::ImageChange::Failed {
        reason: "failed".to_owned(),
    };
    store
        .record_freeze(&node1, images[4], &failed, t(30))
        .await
        .unwrap()
        .unwrap();
    store.delete_image(images[3], t(40)).await.unwrap().unwrap();
    let for_node = |node: &NodeName, since: i64| {
        let filter = ImageFilter::ForNode {
            node: node.clone(),
            removed_since: t(since),
        };
        let store = &store;
        let node = node.clone();
        async move {
            let images = store.images(filter).await.unwrap();
            // The desired state's read finds the same, in the same order, whether its statement
            // finds images to read or none.
            let reads = store
                .desired_reads(&node, t(since))
                .await
                .unwrap()
                .expect("registered");
            assert_eq!(reads.images, images, "{node} since {since}");
            let mut found: Vec<_> = images
                .into_iter()
                .map(|image| (image.id, image.state))
                .collect();
            found.sort_by_key(|(id, _)| *id);
            found
        }
    };
    let sorted = |mut v: Vec<(uuid::Uuid, ImageState)>| {
        v.sort_by_key(|(id, _)| *id);
        v
    };
    assert_eq!(
        for_node(&node1, 30).await,
        sorted(vec![
            (images[0], ImageState::Building),
            (images[3], ImageState::Deleted)
        ])
    );
    assert_eq!(
        for_node(&node2, 30).await,
        sorted(vec![
            (images[1], ImageState::Building),
            (images[3], ImageState::Deleted)
        ])
    );
    assert_eq!(
        for_node(&node1, 15).await,
        sorted(vec![
            (images[0], ImageState::Building),
            (images[2], ImageState::Deleted),
            (images[3], ImageState::Deleted)
        ])
    );
    assert_eq!(
        for_node(&node2, 50).await,
        vec![(images[1], ImageState::Building)]
    );
    // A node with no freeze of its own: the removed images alone, then none.
    assert_eq!(
        for_node(&node3, 30).await,
        vec![(images[3], ImageState::Deleted)]
    );
    assert_eq!(for_node(&node3, 50).await, vec![]);
}

/// A freeze of `session` on `node` into `reference`, ordered at t(10): BUILDING there.
async fn freeze_order(
    store: &TestStore,
    session: &SessionRecord,
    node: &NodeName,
    reference: &str,
) -> crate::domain::images::ImageRecord {
    store
        .create_image(NewImage {
            id: uuid::Uuid::new_v4(),
            owner: session.owner.clone(),
            reference: ongrid_core::image::ImageReference::parse(reference).unwrap(),
            session_id: session.id,
            session_name: session.name.clone(),
            node: node.clone(),
            base_image: "ongrid/dev:latest".to_owned(),
            compression: Default::default(),
            force: false,
            at: t(10),
            reason: "frozen".to_owned(),
        })
        .await
        .unwrap()
}

/// A node's resuming sessions are those STARTING on it that ran before (released from a hold
/// and placed again): not one placed for the first time, not one that ran but waits in the
/// queue, not one on another node.
async fn a_node_resumes_the_starting_sessions_that_ran_before(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    register(&store, "node2", &[gpu(3)], t(0)).await;
    let node1 = NodeName::parse("node1").unwrap();
    let node2 = NodeName::parse("node2").unwrap();
    let placed = |session: &SessionRecord, node: &NodeName, gpu: GpuInfo, at| {
        let place = Placement::Place {
            node: node.clone(),
            gpus: vec![GpuId::Gpu(gpu.uuid)],
        };
        moved(
            &store,
            session.id,
            change(SessionState::Starting, t(at), "placed", place),
        )
    };
    let ran = create(&store, &alice.dn, Some("ran"), t(1)).await;
    let new = create(&store, &alice.dn, Some("new"), t(1)).await;
    let elsewhere = create(&store, &alice.dn, Some("elsewhere"), t(1)).await;
    let held = Change::hold(ongrid_core::holds::HoldReason::Admin, t(4), "held");
    let released = change(SessionState::Pending, t(5), "released", Placement::Clear);
    let ready = Change::keep_placement(SessionState::Waiting, t(3), "ready");
    for (session, node, gpu) in [(&ran, &node1, gpu(1)), (&elsewhere, &node2, gpu(3))] {
        placed(session, node, gpu, 2).await;
        moved(&store, session.id, ready.clone()).await;
    }
    assert_eq!(store.resuming_on(&node1).await.unwrap(), vec![]);
    for id in [ran.id, elsewhere.id] {
        moved(&store, id, held.clone()).await;
        moved(&store, id, released.clone()).await;
    }
    assert_eq!(store.resuming_on(&node1).await.unwrap(), vec![]);
    placed(&new, &node1, gpu(2), 6).await;
    placed(&ran, &node1, gpu(1), 6).await;
    placed(&elsewhere, &node2, gpu(3), 6).await;
    assert_eq!(store.resuming_on(&node1).await.unwrap(), vec![ran.id]);
    assert_eq!(store.resuming_on(&node2).await.unwrap(), vec![elsewhere.id]);
}

/// A node's desired state read with its work on one connection
/// ([`Store::desired_reads_and_work`]) finds what the reads alone find: its GPUs and images (a
/// freeze under way), its sessions, those of them resuming, its jobs (one running there, one of
/// another node, one queued), with the GPUs and jobs read there or taken from what the
/// planning reads keep; nothing for a node not registered.
async fn a_nodes_desired_state_reads_its_work_on_one_connection_as_alone(backend: Backend) {
    use crate::domain::jobs;

    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1), gpu(2), gpu(3)], t(0)).await;
    register(&store, "node2", &[gpu(4)], t(0)).await;
    let node1 = NodeName::parse("node1").unwrap();
    let node2 = NodeName::parse("node2").unwrap();
    let place = |node: &NodeName, gpu: GpuInfo| Placement::Place {
        node: node.clone(),
        gpus: vec![GpuId::Gpu(gpu.uuid)],
    };
    let placed = |at| {
        change(
            SessionState::Starting,
            t(at),
            "placed",
            place(&node1, gpu(1)),
        )
    };
    // One session that ran, was held and placed again (resuming); one placed for the first time.
    let ran = create(&store, &alice.dn, Some("ran"), t(1)).await;
    moved(&store, ran.id, placed(2)).await;
    let ready = Change::keep_placement(SessionState::Waiting, t(3), "ready");
    moved(&store, ran.id, ready).await;
    let held = Change::hold(ongrid_core::holds::HoldReason::Admin, t(4), "held");
    moved(&store, ran.id, held).await;
    moved(
        &store,
        ran.id,
        change(SessionState::Pending, t(5), "released", Placement::Clear),
    )
    .await;
    moved(&store, ran.id, placed(6)).await;
    let new = create(&store, &alice.dn, Some("new"), t(6)).await;
    let second = change(
        SessionState::Starting,
        t(6),
        "placed",
        place(&node1, gpu(2)),
    );
    moved(&store, new.id, second).await;
    let mut running = Vec::new();
    for (node, gpu) in [(&node1, gpu(3)), (&node2, gpu(4))] {
        let job = queued_job(&store, t(7), None).await;
        let started = jobs::start(&job, node.clone(), vec![GpuId::from(gpu.uuid)], t(8)).unwrap();
        running.push(
            store
                .job_transition(job.id, started, None)
                .await
                .unwrap()
                .id,
        );
    }
    queued_job(&store, t(9), None).await;
    // A freeze of `new` under way on node1: its order is in node1's desired state.
    let image = freeze_order(&store, &new, &node1, "img:v1").await;

    // Before the planning reads kept the GPUs and jobs (each read on the connection), then
    // from what they keep.
    for kept in [false, true] {
        if kept {
            store.planning_nodes(t(0)).await.unwrap();
            store.jobs(JobFilter::Active).await.unwrap();
        }
        for node in [&node1, &node2] {
            let (reads, work) = store
                .desired_reads_and_work(node, t(0))
                .await
                .unwrap()
                .expect("registered");
            let alone = store.desired_reads(node, t(0)).await.unwrap();
            assert_eq!(Some(&reads), alone.as_ref(), "{node}, kept {kept}");
            let sessions = store.sessions(SessionFilter::Node(node.clone())).await;
            assert_eq!(work.sessions, sessions.unwrap(), "{node}, kept {kept}");
            assert_eq!(work.ran_before, store.resuming_on(node).await.unwrap());
            let jobs = store.jobs(JobFilter::Node(node.clone())).await.unwrap();
            assert_eq!(work.jobs, jobs, "{node}, kept {kept}");
        }
        let (reads, work) = store
            .desired_reads_and_work(&node1, t(0))
            .await
            .unwrap()
            .unwrap();
        let gpus: Vec<_> = reads.gpus.iter().map(|g| g.info.uuid.clone()).collect();
        assert_eq!(gpus, [gpu(1).uuid, gpu(2).uuid, gpu(3).uuid]);
        let images: Vec<_> = reads.images.iter().map(|i| i.id).collect();
        assert_eq!(images, [image.id]);
        let ids: Vec<_> = work.sessions.iter().map(|s| s.id).collect();
        assert_eq!(ids, [ran.id, new.id]);
        assert_eq!(work.ran_before, [ran.id]);
        let jobs: Vec<_> = work.jobs.iter().map(|j| j.id).collect();
        assert_eq!(jobs, [running[0]]);
    }
    let unknown = NodeName::parse("node9").unwrap();
    assert_eq!(
        store.desired_reads_and_work(&unknown, t(0)).await.unwrap(),
        None
    );
}

/// A session's own idle timeout and maximum lifetime are stored with it, in its creation's
/// write (no round sees it without them); one asking for neither has the site's defaults.
async fn a_session_is_created_with_its_own_lifecycle_limits(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let owner = dn("limits");
    store.user(&owner, 20_000).await.unwrap();
    let limited = store
        .create_session(NewSession {
            idle_timeout_secs: Some(600),
            max_duration_secs: Some(7_200),
            ..new_session(&owner, Some("limited"), t(0))
        })
        .await
        .unwrap();
    let plain = create(&store, &owner, Some("plain"), t(1)).await;
    let limits = |id| {
        let store = store.clone();
        async move {
            let facts = store
                .lifecycle_facts(crate::store::FactsScope::Session(id))
                .await
                .unwrap();
            (facts[0].idle_timeout_secs, facts[0].max_duration_secs)
        }
    };
    assert_eq!(limits(limited.id).await, (Some(600), Some(7_200)));
    assert_eq!(limits(plain.id).await, (None, None));
}

/// The planning read of the sessions is, after every write made through any store on the
/// database (a replica), what a full read of the PENDING and GPU-holding sessions gives, in the
/// same order: new sessions, a placement, a hold and an end in one write, a re-queue; a store
/// opened later reads them whole, then follows too.
async fn the_planning_read_of_sessions_follows_every_write_made_through_any_store(
    backend: Backend,
) {
    let (place, store) = Place::opened(backend).await;
    let replica = place.open().await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let planned = || {
        SessionFilter::States(
            SessionState::ALL
                .into_iter()
                .filter(|s| *s == SessionState::Pending || s.holds_gpus())
                .collect(),
        )
    };
    let current = |stores: Vec<TestStore>| async move {
        let seen = stores[0].sessions(planned()).await.unwrap();
        for store in &stores {
            let planned = store.planning_sessions().await.unwrap();
            assert_eq!(
                planned.iter().map(|s| &**s).collect::<Vec<_>>(),
                seen.iter().collect::<Vec<_>>()
            );
        }
        seen
    };
    let a = create(&store, &alice.dn, Some("a"), t(1)).await;
    let both = || vec![store.clone(), replica.clone()];
    assert_eq!(current(both()).await.len(), 1);
    // Made after the first read, through either store; b and a were made at the same time.
    let b = create(&replica, &alice.dn, Some("b"), t(1)).await;
    let c = create(&store, &alice.dn, Some("c"), t(0)).await;
    assert_eq!(current(both()).await.len(), 3);

    register(&store, "node1", &[gpu(1)], t(0)).await;
    let on_gpu1 = on_node1(&gpu(1));
    moved(
        &replica,
        a.id,
        change(SessionState::Starting, t(2), "placed", on_gpu1),
    )
    .await;
    let seen = current(both()).await;
    assert_eq!(
        seen.iter().find(|s| s.id == a.id).unwrap().state,
        SessionState::Starting
    );

    // Two leave in one write: one held, one ended.
    let hold = Change::hold(ongrid_core::holds::HoldReason::Admin, t(3), "held by root");
    let ended = change(SessionState::Ended, t(3), "removed", Placement::Clear);
    let outcomes = store
        .transition_all(vec![(b.id, hold), (c.id, ended)])
        .await
        .unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(current(both()).await.len(), 1);

    let requeued = change(
        SessionState::Pending,
        t(4),
        "node1 stopped responding",
        Placement::Clear,
    );
    replica.transition(a.id, requeued).await.unwrap();
    let seen = current(both()).await;
    assert_eq!((seen[0].id, seen[0].state), (a.id, SessionState::Pending));

    let late = place.open().await;
    let d = create(&late, &alice.dn, Some("d"), t(5)).await;
    let seen = current(vec![late.clone(), store.clone(), replica.clone()]).await;
    assert_eq!(seen.iter().map(|s| s.id).collect::<Vec<_>>(), [a.id, d.id]);
}

/// A node's GPUs as its desired state reads them ([`Store::desired_reads`]).
async fn node_gpus(store: &TestStore, node: &NodeName) -> Option<std::sync::Arc<[GpuRecord]>> {
    store
        .desired_reads(node, t(0))
        .await
        .unwrap()
        .map(|reads| reads.gpus)
}

/// The planning read keeps the nodes and GPUs it read and reads them again when the inventory
/// changed: each change the scheduler plans with (a GPU's health, mode or drain, a node's drain,
/// a node registered again or removed, a node's GPUs added) is in the next planning read,
/// whether made through the same store or through another one on the same database (a
/// replica); a new utilisation alone is not, while what people see has it. A node's last sync
/// is current when it is before the read's cutoff, and at least the cutoff after it. One node's
/// planning GPUs are the same, read alone before a planning read of every node and kept after
/// it; a node not registered, or removed, has none.
async fn the_planning_read_follows_every_change_of_the_gpus_made_through_any_store(
    backend: Backend,
) {
    let (place, store) = Place::opened(backend).await;
    let replica = place.open().await;
    let node1 = NodeName::parse("node1").unwrap();
    // Every node seen before it: each one's last sync as stored.
    let cutoff = t(1000);
    assert_eq!(store.planning_nodes(cutoff).await.unwrap().nodes, vec![]);
    assert_eq!(replica.planning_nodes(cutoff).await.unwrap().nodes, vec![]);
    // Not registered: `None`, not an empty list of GPUs.
    assert_eq!(node_gpus(&store, &node1).await, None);
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    // Each store's planning read is the whole truth after a change, whoever made it.
    let both_current = || async {
        let seen = store.nodes().await.unwrap();
        let node1_gpus = &seen.iter().find(|n| n.name == node1).unwrap().gpus;
        for planner in [&store, &replica] {
            let gpus = || async { node_gpus(planner, &node1).await };
            assert_eq!(gpus().await.as_ref(), Some(node1_gpus));
            assert_eq!(planner.planning_nodes(cutoff).await.unwrap().nodes, seen);
            assert_eq!(gpus().await.as_ref(), Some(node1_gpus));
        }
        seen
    };
    assert_eq!(both_current().await[0].gpus.len(), 2);

    // A new utilisation alone: people see it, planning keeps the GPU as it was; the sync's time
    // is current.
    let busy = GpuInfo {
        utilization_percent: Some(87),
        ..gpu(2)
    };
    replica
        .record_sync(&node1, &[gpu(1), busy.clone()], t(5))
        .await
        .unwrap();
    assert_eq!(store.nodes().await.unwrap()[0].gpus[1].info, busy);
    for planned in [
        store.planning_nodes(cutoff).await.unwrap().nodes,
        replica.planning_nodes(cutoff).await.unwrap().nodes,
    ] {
        assert_eq!(planned[0].last_seen, t(5));
        assert_eq!(
            planned[0].gpus[1].info,
            gpu(2),
            "utilisation as of the last change"
        );
    }
    for planner in [&store, &replica] {
        let gpus = node_gpus(planner, &node1).await.unwrap();
        assert_eq!(gpus[1].info, gpu(2));
    }

    // Health (through the replica), a mode (through this store), a GPU's drain, a node's drain,
    // another node: each in both stores' next planning read.
    let mut sick = gpu(1);
    sick.health = GpuHealth::Failed("fell off the bus".to_owned());
    replica
        .record_sync(&node1, &[sick.clone(), busy.clone()], t(6))
        .await
        .unwrap();
    assert_eq!(both_current().await[0].gpus[0].info, sick);
    let shared = GpuMode::Shared { max_sessions: 4 };
    store.set_gpu_mode(&gpu(2).uuid, shared).await.unwrap();
    assert_eq!(both_current().await[0].gpus[1].mode, shared);
    let drain = ongrid_core::gpu::Drain {
        reason: "fan".to_owned(),
        since: t(7),
        by: "admin".to_owned(),
    };
    replica
        .set_gpu_drain(&gpu(2).uuid, Some(drain.clone()))
        .await
        .unwrap();
    assert_eq!(both_current().await[0].gpus[1].drain, Some(drain.clone()));
    store
        .set_node_drain(&node1, Some(drain.clone()))
        .await
        .unwrap();
    assert_eq!(both_current().await[0].drain, Some(drain));
    register(&replica, "node0", &[gpu(3)], t(8)).await;
    let seen = both_current().await;
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].gpus[0].info, gpu(3));

    // The owners and reservations, kept with the inventory's version: each one set through
    // either store is in both stores' next read.
    let physics = crate::domain::policy::GroupName::parse("physics").unwrap();
    let chemistry = crate::domain::policy::GroupName::parse("chemistry").unwrap();
    let node0 = NodeName::parse("node0").unwrap();
    let policy_in_both = || async {
        let policy = store.gpu_policy().owners_and_reservations().await.unwrap();
        assert_eq!(
            replica
                .gpu_policy()
                .owners_and_reservations()
                .await
                .unwrap(),
            policy
        );
        policy
    };
    let owners_in_both = || async { policy_in_both().await.owners };
    assert_eq!(owners_in_both().await, Default::default());
    assert!(replica
        .gpu_policy()
        .set_node_owner(&node0, Some(&physics))
        .await
        .unwrap());
    assert_eq!(
        owners_in_both().await.nodes,
        BTreeMap::from([(node0.clone(), physics.clone())])
    );
    assert!(store
        .gpu_policy()
        .set_gpu_owner(&gpu(1).uuid, Some(&chemistry))
        .await
        .unwrap());
    assert!(store
        .gpu_policy()
        .set_gpu_owner(&gpu(3).uuid, Some(&chemistry))
        .await
        .unwrap());
    let owners = owners_in_both().await;
    assert_eq!(
        owners.nodes,
        BTreeMap::from([(node0.clone(), physics.clone())])
    );
    assert_eq!(
        owners.gpus,
        BTreeMap::from([
            (gpu(1).uuid, chemistry.clone()),
            (gpu(3).uuid, chemistry.clone())
        ])
    );
    assert!(replica
        .gpu_policy()
        .set_gpu_owner(&gpu(1).uuid, None)
        .await
        .unwrap());
    assert_eq!(owners_in_both().await.gpus.len(), 1);
    let course = crate::domain::policy::reservations::ReservationRecord {
        name: crate::domain::policy::reservations::ReservationName::parse("course").unwrap(),
        group: physics.clone(),
        node: Some(node0.clone()),
        gpus: Vec::new(),
        from: t(30),
        to: t(40),
        created_by: ongrid_core::UserName::parse("root").unwrap(),
        created_at: t(7),
    };
    assert!(replica.gpu_policy().add_reservation(&course).await.unwrap());
    assert_eq!(
        policy_in_both().await.reservations,
        std::slice::from_ref(&course)
    );
    assert_eq!(
        store
            .gpu_policy()
            .remove_reservation(&course.name)
            .await
            .unwrap(),
        Some(course)
    );
    assert_eq!(policy_in_both().await.reservations, []);
    // Read again with the owners' and reservations' changes, before node0's next sync.
    both_current().await;

    // A last sync is read exactly only before the cutoff: node0, seen again at t(20), shows the
    // cutoff t(10) (what was read at t(8) is older); node1, seen at t(6), shows t(6). Against a
    // later cutoff both show their last sync as stored.
    replica
        .record_sync(&seen[0].name, &[gpu(3)], t(20))
        .await
        .unwrap();
    for planner in [&store, &replica] {
        let seen_at =
            |planned: Vec<NodeRecord>| -> Vec<_> { planned.iter().map(|n| n.last_seen).collect() };
        assert_eq!(
            seen_at(planner.planning_nodes(t(10)).await.unwrap().nodes),
            [t(10), t(6)]
        );
        assert_eq!(
            seen_at(planner.planning_nodes(t(30)).await.unwrap().nodes),
            [t(20), t(6)]
        );
    }

    // Registered again (its stream moved, its GPUs as they were), then removed.
    let moved = NodeRegistration {
        stream_url: Some("wss://node0.example:9443/streams".to_owned()),
        ..registration("node0")
    };
    store.register_node(moved, &[gpu(3)], t(21)).await.unwrap();
    let seen = both_current().await;
    assert_eq!(
        seen[0].stream_url.as_deref(),
        Some("wss://node0.example:9443/streams")
    );
    let removal = replica
        .remove_node(&seen[0].name, t(100), std::time::Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(removal, NodeRemoval::Removed);
    // Removed: no GPUs for it, before a planning read of every node and after it.
    for planner in [&store, &replica] {
        assert_eq!(node_gpus(planner, &seen[0].name).await, None);
    }
    let removed = seen[0].name.clone();
    let seen = both_current().await;
    for planner in [&store, &replica] {
        assert_eq!(node_gpus(planner, &removed).await, None);
    }
    let names: Vec<&NodeName> = seen.iter().map(|n| &n.name).collect();
    assert_eq!(names, [&node1]);
    // A removed node's owner and its GPUs' owners no longer count.
    assert_eq!(owners_in_both().await, Default::default());
}

/// Changes stored in one write: each one its session's lifecycle allows is stored, a refused
/// one and one of an unknown session are answered as refused, and nothing of them is written.
async fn changes_stored_together_skip_the_refused_ones(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let first = create(&store, &alice.dn, Some("a"), t(1)).await;
    let second = create(&store, &alice.dn, Some("b"), t(1)).await;
    let unknown = SessionId::new_random();
    let hold = |at| Change::hold(ongrid_core::holds::HoldReason::Admin, t(at), "held by root");
    let outcomes = store
        .transition_all(vec![
            (first.id, hold(2)),
            (unknown, hold(2)),
            // PENDING to CONNECTED is not a transition of the lifecycle.
            (
                second.id,
                Change::keep_placement(SessionState::Connected, t(2), "connected"),
            ),
            (second.id, hold(3)),
            // A session changed a second time in the same write: after its first change.
            (
                first.id,
                change(SessionState::Ended, t(4), "removed", Placement::Keep),
            ),
        ])
        .await
        .unwrap();
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
    assert!(matches!(outcomes[1], Err(StoreError::NoSuchSession(id)) if id == unknown));
    assert!(matches!(outcomes[2], Err(StoreError::InvalidTransition(_))));
    assert!(outcomes[3].is_ok(), "{outcomes:?}");
    assert!(outcomes[4].is_ok(), "{outcomes:?}");
    use SessionState::{Ended, Held, Pending};
    for (id, expected) in [
        (first.id, vec![Pending, Held, Ended]),
        (second.id, vec![Pending, Held]),
    ] {
        let session = store.session(id).await.unwrap().unwrap();
        assert_eq!(Some(&session.state), expected.last());
        let states: Vec<SessionState> = store
            .transitions(id)
            .await
            .unwrap()
            .iter()
            .map(|t| t.to)
            .collect();
        assert_eq!(states, expected);
    }
    assert!(store.transition_all(Vec::new()).await.unwrap().is_empty());
    counts_match_the_tables(&store).await;
}

/// A round's placements and job changes stored in one write: each one allowed is stored and
/// read for planning after it; a refused one of either kind is answered as refused and nothing
/// of it is written; a round with nothing to store writes nothing.
async fn a_rounds_placements_and_job_changes_are_stored_in_one_write(backend: Backend) {
    use crate::domain::jobs;
    use ongrid_core::job::JobState;

    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let node = NodeName::parse("node1").unwrap();
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    let session = create(&store, &alice.dn, Some("a"), t(1)).await;
    let job = queued_job(&store, t(1), None).await;
    // Read for planning before the write, so the reads after it are of the changes since.
    assert_eq!(store.planning_sessions().await.unwrap().len(), 1);
    assert_eq!(store.planning_jobs().await.unwrap().len(), 1);
    let (unknown_session, unknown_job) = (SessionId::new_random(), JobId::new_random());
    let outcomes = store
        .round_changes(
            vec![
                (
                    session.id,
                    change(SessionState::Starting, t(2), "placed", on_node1(&gpu(1))),
                ),
                (
                    unknown_session,
                    change(SessionState::Starting, t(2), "placed", on_node1(&gpu(1))),
                ),
            ],
            vec![
                (
                    unknown_job,
                    jobs::cancel_by_owner(&job, t(2)).unwrap(),
                    None,
                ),
                (
                    job.id,
                    jobs::start(&job, node.clone(), vec![GpuId::from(gpu(2).uuid)], t(2)).unwrap(),
                    None,
                ),
            ],
        )
        .await
        .unwrap();
    assert!(outcomes.sessions[0].is_ok(), "{outcomes:?}");
    assert!(
        matches!(outcomes.sessions[1], Err(StoreError::NoSuchSession(id)) if id == unknown_session)
    );
    assert!(matches!(outcomes.jobs[0], Err(StoreError::NoSuchJob(id)) if id == unknown_job));
    assert!(outcomes.jobs[1].is_ok(), "{outcomes:?}");
    assert_eq!((outcomes.sessions.len(), outcomes.jobs.len()), (2, 2));

    let placed = store.session(session.id).await.unwrap().unwrap();
    assert_eq!(
        (placed.state, placed.node.as_ref()),
        (SessionState::Starting, Some(&node))
    );
    let started = store.job(job.id).await.unwrap().unwrap();
    assert_eq!(
        (started.state(), started.node.as_ref()),
        (JobState::Running, Some(&node))
    );
    assert!(store.session(unknown_session).await.unwrap().is_none());
    assert!(store.job(unknown_job).await.unwrap().is_none());
    let planned = store.planning_sessions().await.unwrap();
    assert_eq!(planned[0].state, SessionState::Starting);
    let planned = store.planning_jobs().await.unwrap();
    assert_eq!(planned[0].state(), JobState::Running);

    let none = store.round_changes(Vec::new(), Vec::new()).await.unwrap();
    assert!(none.sessions.is_empty() && none.jobs.is_empty());
    counts_match_the_tables(&store).await;
}

/// Changes stored in one write set each session's own state, reason and placement: a round's
/// placements on different GPUs, then a start, a requeue and another placement together.
async fn changes_stored_together_each_set_their_own_session(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1), gpu(2), gpu(3)], t(0)).await;
    let [a, b, c] = [
        create(&store, &alice.dn, Some("a"), t(1)).await,
        create(&store, &alice.dn, Some("b"), t(1)).await,
        create(&store, &alice.dn, Some("c"), t(1)).await,
    ];
    // Read for planning before the writes, so the read after them is one of the changes since.
    let planned_before = store.planning_sessions().await.unwrap();
    assert_eq!(planned_before.len(), 3);
    let outcomes = store
        .transition_all(vec![
            (
                a.id,
                change(SessionState::Starting, t(2), "placed a", on_node1(&gpu(1))),
            ),
            (
                b.id,
                change(SessionState::Starting, t(2), "placed b", on_node1(&gpu(2))),
            ),
        ])
        .await
        .unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let outcomes = store
        .transition_all(vec![
            (
                a.id,
                change(SessionState::Waiting, t(3), "started", Placement::Keep),
            ),
            (
                b.id,
                change(SessionState::Pending, t(3), "node lost", Placement::Clear),
            ),
            (
                c.id,
                change(SessionState::Starting, t(3), "placed c", on_node1(&gpu(3))),
            ),
        ])
        .await
        .unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let expected = [
        (a.id, SessionState::Waiting, "started", Some(gpu(1))),
        (b.id, SessionState::Pending, "node lost", None),
        (c.id, SessionState::Starting, "placed c", Some(gpu(3))),
    ];
    let planned = store.planning_sessions().await.unwrap();
    for (id, state, reason, on) in expected {
        let session = store.session(id).await.unwrap().unwrap();
        assert_eq!(session.state, state, "{}", session.name);
        assert_eq!(session.reason, reason, "{}", session.name);
        assert_eq!(
            session.node,
            on.as_ref().map(|_| NodeName::parse("node1").unwrap()),
            "{}",
            session.name
        );
        let gpus: Vec<GpuId> = on.iter().map(|g| GpuId::Gpu(g.uuid.clone())).collect();
        assert_eq!(session.gpus, gpus, "{}", session.name);
        // The planning read follows them (each stamped with the write's change number).
        let kept = planned.iter().find(|s| s.id == id).unwrap();
        assert_eq!(**kept, session, "{}", session.name);
    }
    counts_match_the_tables(&store).await;
}

/// The changes of callers that wait for the write at the same time (nodes' syncs, a removal, a
/// job cancelled, a round) go in one write, each caller's after those of the callers before it,
/// each keeping its own outcomes; the sessions they make ready are ready from then, first started
/// then unless they started before, and one held and released after it started in the same write
/// is ready no more. A caller alone writes alone.
async fn session_and_job_changes_of_callers_waiting_together_share_one_write(backend: Backend) {
    use futures::FutureExt;

    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let gpus = [gpu(1), gpu(2), gpu(3), gpu(4), gpu(5)];
    register(&store, "node1", &gpus, t(0)).await;
    let mut sessions = Vec::new();
    for name in ["a", "b", "c", "d", "e", "f"] {
        sessions.push(create(&store, &alice.dn, Some(name), t(1)).await.id);
    }
    let [a, b, c, d, e, f] = sessions[..] else {
        unreachable!("six sessions")
    };
    let placed = [(a, 1), (b, 2), (c, 3), (e, 4)].map(|(id, n)| {
        let to = change(SessionState::Starting, t(2), "placed", on_node1(&gpu(n)));
        (id, to)
    });
    let outcomes = store.transition_all(placed.to_vec()).await.unwrap();
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    // C started once, at t(3), was held and released, and starts again.
    let keep = |to, at, reason| change(to, t(at), reason, Placement::Keep);
    let hold = |at| Change::hold(ongrid_core::holds::HoldReason::Admin, t(at), "held by root");
    for to in [
        keep(SessionState::Waiting, 3, "started"),
        hold(4),
        keep(SessionState::Pending, 5, "released"),
        keep(SessionState::Starting, 6, "placed again"),
    ] {
        store.transition(c, to).await.unwrap();
    }
    let first = vec![
        (a, keep(SessionState::Waiting, 7, "started")),
        (e, keep(SessionState::Waiting, 7, "started")),
    ];
    let second = vec![
        // STARTING to IDLE is not a transition of the lifecycle: refused, this change alone.
        (b, keep(SessionState::Idle, 7, "idle")),
        (b, keep(SessionState::Waiting, 7, "started")),
        (c, keep(SessionState::Waiting, 7, "started again")),
        // Allowed only once the first caller's change made it ready.
        (a, keep(SessionState::Connected, 8, "connected")),
        (e, hold(8)),
        (e, keep(SessionState::Pending, 9, "released")),
    ];
    let changing = [first, second].map(|changes| {
        let store = store.clone();
        async move { store.transition_all(changes).await.unwrap() }.boxed()
    });
    let removing = {
        let store = store.clone();
        async move {
            let removed = keep(SessionState::Ended, 7, "removed by alice");
            let ended = store.transition(d, removed).await;
            vec![ended.map(|ended| assert_eq!(ended.state, SessionState::Ended))]
        }
        .boxed()
    };
    let [job, started_job] = [
        queued_job(&store, t(1), None).await,
        queued_job(&store, t(1), None).await,
    ];
    let cancelling = {
        let store = store.clone();
        let cancel = crate::domain::jobs::cancel_by_owner(&job, t(7)).unwrap();
        async move {
            store
                .job_transition_all(vec![(job.id, cancel, None)])
                .await
                .unwrap()
        }
        .boxed()
    };
    let node1 = NodeName::parse("node1").unwrap();
    let on = vec![GpuId::from(gpu(5).uuid)];
    let start = crate::domain::jobs::start(&started_job, node1, on, t(7)).unwrap();
    let round = {
        let store = store.clone();
        let placing = change(SessionState::Starting, t(7), "placed", on_node1(&gpu(5)));
        async move {
            let outcomes = store
                .round_changes(vec![(f, placing)], vec![(started_job.id, start, None)])
                .await
                .unwrap();
            outcomes.sessions.into_iter().chain(outcomes.jobs).collect()
        }
        .boxed()
    };
    let callers = changing.into_iter().chain([removing, cancelling, round]);
    let answers = written_together(&store, Together::Changes, callers, async {}).await;
    assert_eq!(
        answers.iter().map(Vec::len).collect::<Vec<_>>(),
        [2, 6, 1, 1, 2]
    );
    assert!(
        matches!(answers[1][0], Err(StoreError::InvalidTransition(_))),
        "{answers:?}"
    );
    let others = answers.iter().flatten().skip(3);
    assert!(
        answers[0].iter().chain(others).all(Result::is_ok),
        "{answers:?}"
    );
    let states = |id: JobId| {
        let store = store.clone();
        async move { store.job(id).await.unwrap().unwrap().state() }
    };
    use ongrid_core::job::JobState;
    assert_eq!(states(job.id).await, JobState::Cancelled);
    assert_eq!(states(started_job.id).await, JobState::Running);
    for (id, state, first_started, ready) in [
        (a, SessionState::Connected, Some(t(7)), Some(t(7))),
        (b, SessionState::Waiting, Some(t(7)), Some(t(7))),
        (c, SessionState::Waiting, Some(t(3)), Some(t(7))),
        (d, SessionState::Ended, None, None),
        // Ready at t(7), then held and released in the same write: ready no more.
        (e, SessionState::Pending, Some(t(7)), None),
        (f, SessionState::Starting, None, None),
    ] {
        let facts = store
            .lifecycle_facts(FactsScope::Session(id))
            .await
            .unwrap();
        assert_eq!(facts[0].state, state, "{id}");
        assert_eq!(facts[0].first_started_at, first_started, "{id}");
        assert_eq!(facts[0].ready_at, ready, "{id}");
    }
    let number = |table, id: String| change_number(&store, table, id);
    let session_number = |id: SessionId| number("sessions", id.to_string());
    for other in [
        session_number(b).await,
        session_number(c).await,
        session_number(d).await,
        session_number(f).await,
        number("jobs", job.id.to_string()).await,
        number("jobs", started_job.id.to_string()).await,
    ] {
        assert_eq!(
            session_number(a).await,
            other,
            "every caller's changes in one write"
        );
    }
    // Alone, a caller's write is its own.
    let outcomes = store
        .transition_all(vec![(b, keep(SessionState::Connected, 9, "connected"))])
        .await
        .unwrap();
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
    assert_ne!(session_number(a).await, session_number(b).await);
    counts_match_the_tables(&store).await;
}

/// The database counts sessions (ended ones left out) and jobs by state, for the metrics.
async fn sessions_and_jobs_are_counted_by_state(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    assert_eq!(store.state_counts().await.unwrap(), StateCounts::default());
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let mut ids = Vec::new();
    for name in ["a", "b", "c"] {
        let session = create(&store, &alice.dn, Some(name), t(1)).await;
        ids.push(session.id);
    }
    let hold = Change::hold(
        ongrid_core::holds::HoldReason::Admin,
        t(2),
        "maintenance (held by root)",
    );
    store.transition(ids[0], hold).await.unwrap();
    let end = Change::keep_placement(SessionState::Ended, t(3), "removed by alice");
    store.transition(ids[1], end).await.unwrap();
    let mut counts = store.state_counts().await.unwrap();
    counts.sessions.sort();
    assert_eq!(
        counts.sessions,
        vec![("HELD".to_owned(), 1), ("PENDING".to_owned(), 1)]
    );
    assert!(counts.jobs.is_empty());
    assert!(counts.gpus_in_use.is_empty());

    // A session holding a GPU counts it in use; one held, its GPU given up, does not.
    register(&store, "node1", &[gpu(1), gpu(2)], t(4)).await;
    let placement = on_node1(&gpu(2));
    moved(
        &store,
        ids[2],
        change(SessionState::Starting, t(5), "placed on node1", placement),
    )
    .await;
    // A job running on the other GPU counts it too.
    let job = queued_job(&store, t(6), None).await;
    let started = crate::domain::jobs::start(
        &job,
        NodeName::parse("node1").unwrap(),
        vec![GpuId::Gpu(gpu(1).uuid)],
        t(7),
    )
    .unwrap();
    store.job_transition(job.id, started, None).await.unwrap();
    let counts = store.state_counts().await.unwrap();
    assert_eq!(
        counts.gpus_in_use.into_iter().collect::<Vec<_>>(),
        [GpuId::Gpu(gpu(1).uuid), GpuId::Gpu(gpu(2).uuid)]
    );
    assert_eq!(counts.jobs, [("RUNNING".to_owned(), 1)]);

    // Holders that let their GPUs go after a count no longer count them: the job finished,
    // the session ended.
    store
        .job_transition(job.id, finished(t(8)), None)
        .await
        .unwrap();
    let counts = store.state_counts().await.unwrap();
    assert_eq!(
        counts.gpus_in_use.into_iter().collect::<Vec<_>>(),
        [GpuId::Gpu(gpu(2).uuid)]
    );
    assert_eq!(counts.jobs, [("FINISHED".to_owned(), 1)]);
    let end = Change::keep_placement(SessionState::Ended, t(9), "removed by alice");
    store.transition(ids[2], end).await.unwrap();
    let counts = store.state_counts().await.unwrap();
    assert!(counts.gpus_in_use.is_empty());
    assert_eq!(counts.sessions, [("HELD".to_owned(), 1)]);

    // A removed job leaves the count; a job submitted after it enters it.
    store.record_job_log(job.id, 0, true).await.unwrap();
    let removal = store
        .remove_job(job.id, std::time::Duration::ZERO, t(10))
        .await
        .unwrap();
    assert!(
        matches!(removal, crate::store::JobRemoval::Removed(_)),
        "{removal:?}"
    );
    assert!(store.state_counts().await.unwrap().jobs.is_empty());
    queued_job(&store, t(11), None).await;
    queued_job(&store, t(12), None).await;
    let counts = store.state_counts().await.unwrap();
    assert_eq!(counts.jobs, [("QUEUED".to_owned(), 2)]);
    counts_match_the_tables(&store).await;
}

/// The counts by state the database keeps (`state_counts`) are those of the tables' rows, every
/// state of both kinds, the ended sessions' too: called after writes of many rows at once.
async fn counts_match_the_tables(store: &TestStore) {
    let kept = store
        .rows(
            "SELECT kind, state, CAST(n AS TEXT) FROM state_counts WHERE n <> 0 \
             ORDER BY kind, state",
            &[],
        )
        .await;
    let counted = store
        .rows(
            "SELECT kind, state, CAST(n AS TEXT) FROM ( \
             SELECT 'job' AS kind, state, COUNT(*) AS n FROM jobs GROUP BY state \
             UNION ALL \
             SELECT 'session' AS kind, state, COUNT(*) AS n FROM sessions GROUP BY state \
             ) counted ORDER BY kind, state",
            &[],
        )
        .await;
    assert_eq!(kept, counted, "the counts kept are the tables' own");
}

/// A database of the release before the counts kept by state (migrations up to 0027), with
/// sessions and jobs in several states: the upgrade counts them, and the counts follow the writes
/// after it.
async fn an_upgrade_counts_the_sessions_and_jobs_already_stored(backend: Backend) {
    let place = Place::new(backend).await;
    let at = stored_time(t(0));
    let request = serde_json::to_string(&GpuRequest::default()).unwrap();
    let mut statements = vec![format!(
        "INSERT INTO users (dn, user_name, uid, created_at) \
         VALUES ('/DC=org/CN=Alice', 'alice', 20000, '{at}')"
    )];
    let sessions = [("PENDING", 2), ("HELD", 1), ("ENDED", 3)];
    for (n, state) in sessions
        .iter()
        .flat_map(|(state, count)| std::iter::repeat_n(*state, *count))
        .enumerate()
    {
        statements.push(format!(
            "INSERT INTO sessions (id, name, owner, request, image, state, reason, created_at, \
             queued_at) VALUES ('{}', 'dev-{n}', '/DC=org/CN=Alice', '{request}', \
             'ongrid/dev:latest', '{state}', 'as stored', '{at}', '{at}')",
            SessionId::new_random()
        ));
    }
    // Ended ones: the planning read (which the GPUs in use come from) would read a live job's
    // history, which these rows have none of.
    let jobs = [("CANCELLED", 1), ("FINISHED", 2)];
    for state in jobs
        .iter()
        .flat_map(|(state, count)| std::iter::repeat_n(*state, *count))
    {
        let id = JobId::new_random();
        statements.push(format!(
            "INSERT INTO jobs (id, owner, state, spec, image_digest, docker_image, \
             chain_initial, restart_count, queued_at) VALUES ('{id}', '/DC=org/CN=Alice', \
             '{state}', '{{}}', 'sha256:00', 'ongrid/job:1', '{id}', 0, '{at}')"
        ));
    }
    place.old_schema_with("0028", &statements).await;

    let store = place.open().await;
    let counts = store.state_counts().await.unwrap();
    assert_eq!(
        counts.sessions,
        [("HELD".to_owned(), 1), ("PENDING".to_owned(), 2)],
        "the ended sessions are not shown"
    );
    assert_eq!(
        counts.jobs,
        [("CANCELLED".to_owned(), 1), ("FINISHED".to_owned(), 2)]
    );
    let ended = store
        .rows(
            "SELECT CAST(n AS TEXT) FROM state_counts WHERE kind = 'session' AND state = 'ENDED'",
            &[],
        )
        .await;
    assert_eq!(ended, [[Some("3".to_owned())]], "but counted");
    queued_job(&store, t(1), None).await;
    let counts = store.state_counts().await.unwrap();
    assert_eq!(
        counts.jobs,
        [
            ("CANCELLED".to_owned(), 1),
            ("FINISHED".to_owned(), 2),
            ("QUEUED".to_owned(), 1)
        ]
    );
    counts_match_the_tables(&store).await;
}

/// PostgreSQL, replicas upgraded one at a time: a write of the release before 0028 still open
/// when the other replica's migration begins is counted once it commits (the migration waits for
/// it), not lost between the counts made of the rows stored and the triggers.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn an_upgrade_counts_a_write_still_open_on_a_replica_of_the_release_before() {
    let place = Place::new(Backend::Postgres).await;
    let at = stored_time(t(0));
    let user = format!(
        "INSERT INTO users (dn, user_name, uid, created_at) \
         VALUES ('/DC=org/CN=Alice', 'alice', 20000, '{at}')"
    );
    place.old_schema_with("0028", &[user]).await;
    let Database::Postgres(url) = &place.database else {
        panic!("{:?}", place.database)
    };
    let old_replica = sqlx::PgPool::connect(url).await.unwrap();
    let mut open = old_replica.begin().await.unwrap();
    let request = serde_json::to_string(&GpuRequest::default()).unwrap();
    sqlx::query(&format!(
        "INSERT INTO sessions (id, name, owner, request, image, state, reason, created_at, \
         queued_at) VALUES ('{}', 'dev', '/DC=org/CN=Alice', '{request}', \
         'ongrid/dev:latest', 'PENDING', 'requested by alice', '{at}', '{at}')",
        SessionId::new_random()
    ))
    .execute(&mut *open)
    .await
    .unwrap();

    let database = place.database.clone();
    let upgrading = tokio::spawn(async move { database.open().await.unwrap() });
    // The migration waits for a lock the open write holds.
    let waits = "SELECT COUNT(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'";
    while sqlx::query_scalar::<_, i64>(waits)
        .fetch_one(&old_replica)
        .await
        .unwrap()
        == 0
    {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    open.commit().await.unwrap();
    old_replica.close().await;

    let store = TestStore(upgrading.await.unwrap());
    let counts = store.state_counts().await.unwrap();
    assert_eq!(counts.sessions, [("PENDING".to_owned(), 1)]);
    counts_match_the_tables(&store).await;
}

/// A token identity links to a user who exists and is not removed, is replaced by a second link,
/// listed, and unlinked once; a key registered with a token keeps its issuer's name, and a
/// renewal with a certificate clears it.
async fn token_identities_link_to_existing_users_and_keys_keep_their_token_issuer(
    backend: Backend,
) {
    use crate::store::TokenLink;
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let bob = store.user(&dn("Bob"), 20_000).await.unwrap();
    let issuer = "https://iam.test.invalid/";
    let link = |who: &Dn, at: i64| TokenLink {
        issuer: issuer.to_owned(),
        subject: "sub-1".to_owned(),
        dn: who.clone(),
        linked_at: t(at),
    };
    assert_eq!(store.token_link(issuer, "sub-1").await.unwrap(), None);
    assert!(!store.link_token(&link(&dn("Nobody"), 0)).await.unwrap());
    assert!(store.link_token(&link(&alice.dn, 1)).await.unwrap());
    assert!(store.link_token(&link(&bob.dn, 2)).await.unwrap());
    assert_eq!(
        store.token_link(issuer, "sub-1").await.unwrap(),
        Some(bob.dn.clone())
    );
    assert_eq!(store.token_links().await.unwrap(), [link(&bob.dn, 2)]);
    assert_eq!(
        store.unlink_token(issuer, "sub-1").await.unwrap(),
        Some(link(&bob.dn, 2))
    );
    assert_eq!(store.unlink_token(issuer, "sub-1").await.unwrap(), None);
    assert!(store.token_links().await.unwrap().is_empty());

    let mut by_token = new_key(&alice.dn, 1, t(0), t(100));
    by_token.token_issuer = Some("iam".to_owned());
    let KeyAdded::New(key) = store.add_key(by_token, 4).await.unwrap() else {
        panic!("a new key")
    };
    assert_eq!(key.token_issuer.as_deref(), Some("iam"));
    let KeyAdded::Renewed(key) = add_key(&store, &alice.dn, 1, t(10), t(200), 4).await else {
        panic!("a renewal")
    };
    assert_eq!(key.token_issuer, None);
    store.close().await;
}

/// The mode an agent asks a GPU to start in is the new GPU's; once stored, the store's mode
/// (an admin's change) wins over what a later registration asks.
async fn a_new_gpu_starts_in_the_mode_its_agent_asks_and_a_known_one_keeps_its_own(
    backend: Backend,
) {
    let (_place, store) = Place::opened(backend).await;
    let shared = GpuMode::Shared { max_sessions: 4 };
    let mut node1 = registration("node1");
    node1.start_modes = [(gpu(1).uuid, shared)].into();
    store
        .register_node(node1.clone(), &[gpu(1), gpu(2)], t(0))
        .await
        .unwrap();
    let modes =
        |nodes: Vec<NodeRecord>| -> Vec<GpuMode> { nodes[0].gpus.iter().map(|g| g.mode).collect() };
    assert_eq!(
        modes(store.nodes().await.unwrap()),
        [shared, GpuMode::Exclusive]
    );
    store
        .set_gpu_mode(&gpu(1).uuid, GpuMode::Exclusive)
        .await
        .unwrap();
    node1.start_modes = [(gpu(1).uuid, shared), (gpu(2).uuid, shared)].into();
    store
        .register_node(node1, &[gpu(1), gpu(2)], t(1))
        .await
        .unwrap();
    assert_eq!(
        modes(store.nodes().await.unwrap()),
        [GpuMode::Exclusive, GpuMode::Exclusive]
    );
    store.close().await;
}

/// A new store gets a random id at generation 1, kept when it is opened again; two stores have
/// two ids; `mark-restored` raises the generation by one, or to the generation asked when
/// that is higher, and keeps the id.
async fn a_store_keeps_its_identity_and_a_restore_raises_its_generation(backend: Backend) {
    let (place, store) = Place::opened(backend).await;
    let identity = store.identity().await.unwrap();
    assert_eq!(identity.generation, 1);
    assert_eq!(identity.id.len(), 32, "{identity}");
    store.close().await;
    let store = place.open().await;
    assert_eq!(store.identity().await.unwrap(), identity);
    let (_other_place, other) = Place::opened(backend).await;
    assert_ne!(other.identity().await.unwrap().id, identity.id);
    other.close().await;

    let restored = store.mark_restored(None).await.unwrap();
    assert_eq!((&restored.id, restored.generation), (&identity.id, 2));
    assert_eq!(store.identity().await.unwrap(), restored);
    assert_eq!(store.mark_restored(Some(7)).await.unwrap().generation, 7);
    assert_eq!(store.mark_restored(Some(3)).await.unwrap().generation, 8);
    store.close().await;
}

/// Whoever adds a SQLite migration ports it: `migrations-postgres/` holds a file of the same
/// version and name for every file of `migrations/`, and nothing else.
#[test]
fn both_backends_have_the_same_migrations() {
    let names = |dir: &str| -> BTreeSet<String> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        std::fs::read_dir(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".sql"))
            .collect()
    };
    let sqlite = names("migrations");
    let postgres = names("migrations-postgres");
    let unported: Vec<&String> = sqlite.difference(&postgres).collect();
    let unknown: Vec<&String> = postgres.difference(&sqlite).collect();
    assert!(
        unported.is_empty() && unknown.is_empty(),
        "session-manager/migrations-postgres/ must hold the PostgreSQL port of every file of \
         session-manager/migrations/, under the same name: not ported {unported:?}; no SQLite \
         original {unknown:?}"
    );
    assert!(sqlite.len() >= 13, "{sqlite:?}");
}

fn t(secs: i64) -> DateTime<Utc> {
    // Nanoseconds included, to prove timestamps round-trip exactly.
    Utc.timestamp_opt(1_700_000_000 + secs, 123_456_789)
        .unwrap()
}

/// A time as the stores keep it.
fn stored_time(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

fn dn(cn: &str) -> Dn {
    Dn::parse(&format!("/DC=org/DC=example/CN={cn}")).unwrap()
}

fn new_session(owner: &Dn, name: Option<&str>, at: DateTime<Utc>) -> NewSession {
    NewSession {
        name: name.map(|n| SessionName::parse(n).unwrap()),
        request: GpuRequest {
            count: 1,
            min_capability: Some(ComputeCapability::new(8, 0)),
            min_memory: None,
            sharing: Sharing::Exclusive,
        },
        ..fixtures::new_session(owner, at)
    }
}

fn change(to: SessionState, at: DateTime<Utc>, reason: &str, placement: Placement) -> Change {
    Change {
        to,
        at,
        reason: reason.to_owned(),
        hold: None,
        placement,
    }
}

/// Registers node `name` with `gpus` at `at`, as its agent does.
async fn register(store: &TestStore, name: &str, gpus: &[GpuInfo], at: DateTime<Utc>) {
    store
        .register_node(registration(name), gpus, at)
        .await
        .unwrap();
}

/// `owner`'s new PENDING session `name` (the first free default name for none), made at `at`.
async fn create(
    store: &TestStore,
    owner: &Dn,
    name: Option<&str>,
    at: DateTime<Utc>,
) -> SessionRecord {
    store
        .create_session(new_session(owner, name, at))
        .await
        .unwrap()
}

/// Stores `change` of session `id`, which its lifecycle allows.
async fn moved(store: &TestStore, id: SessionId, change: Change) -> SessionRecord {
    store.transition(id, change).await.unwrap()
}

/// A placement on `gpu` of node1.
fn on_node1(gpu: &GpuInfo) -> Placement {
    Placement::Place {
        node: NodeName::parse("node1").unwrap(),
        gpus: vec![GpuId::Gpu(gpu.uuid.clone())],
    }
}

async fn a_reopened_file_gives_everything_back(backend: Backend) {
    let (place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice Smith"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    let shared = GpuMode::Shared { max_sessions: 4 };
    store.set_gpu_mode(&gpu(2).uuid, shared).await.unwrap();
    let created = create(&store, &alice.dn, Some("train1"), t(1)).await;
    let placement = on_node1(&gpu(1));
    moved(
        &store,
        created.id,
        change(SessionState::Starting, t(2), "placed on node1", placement),
    )
    .await;
    let before_session = store.session(created.id).await.unwrap().unwrap();
    let before_history = store.transitions(created.id).await.unwrap();
    let before_nodes = store.nodes().await.unwrap();
    store.close().await;
    drop(store);

    let store = place.open().await;
    assert_eq!(store.user(&alice.dn, 20_000).await.unwrap(), alice);
    assert_eq!(
        store.session(created.id).await.unwrap().unwrap(),
        before_session
    );
    assert_eq!(store.transitions(created.id).await.unwrap(), before_history);
    assert_eq!(store.nodes().await.unwrap(), before_nodes);
    assert_eq!(before_session.state, SessionState::Starting);
    assert_eq!(before_session.created_at, t(1));
    assert_eq!(before_history.len(), 2);
    assert_eq!(before_history[1].at, t(2));
    assert_eq!(before_nodes[0].gpus[1].mode, shared);
}

async fn transitions_go_through_the_lifecycle(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let session = create(&store, &alice.dn, None, t(0)).await;
    assert_eq!(session.state, SessionState::Pending);
    assert_eq!(session.reason, "created");

    let err = store
        .transition(
            session.id,
            change(SessionState::Connected, t(1), "x", Placement::Keep),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::InvalidTransition(ref e) if e.from == SessionState::Pending),
        "{err}"
    );
    assert_eq!(store.transitions(session.id).await.unwrap().len(), 1);

    let node1 = NodeName::parse("node1").unwrap();
    register(&store, "node1", &[gpu(1)], t(0)).await;
    let placed = moved(
        &store,
        session.id,
        change(SessionState::Starting, t(1), "placed", on_node1(&gpu(1))),
    )
    .await;
    assert_eq!(placed.node.as_ref(), Some(&node1));
    assert_eq!(placed.gpus, vec![GpuId::Gpu(gpu(1).uuid)]);
    let back = moved(
        &store,
        session.id,
        change(
            SessionState::Pending,
            t(2),
            "node1 stopped responding",
            Placement::Clear,
        ),
    )
    .await;
    assert_eq!(back.node, None);
    assert!(back.gpus.is_empty());
    assert_eq!(back.queued_at, t(0), "a re-queued session keeps its place");
    let ended = moved(
        &store,
        session.id,
        change(
            SessionState::Ended,
            t(3),
            "removed by alice",
            Placement::Keep,
        ),
    )
    .await;
    assert_eq!(ended.reason, "removed by alice");
    let history = store.transitions(session.id).await.unwrap();
    let states: Vec<_> = history.iter().map(|t| (t.from, t.to)).collect();
    use SessionState::*;
    assert_eq!(
        states,
        vec![
            (None, Pending),
            (Some(Pending), Starting),
            (Some(Starting), Pending),
            (Some(Pending), Ended)
        ]
    );
    let missing = SessionId::new_random();
    assert!(matches!(
        store
            .transition(missing, change(Ended, t(4), "x", Placement::Keep))
            .await,
        Err(StoreError::NoSuchSession(id)) if id == missing
    ));
}

async fn names_are_unique_per_owner_among_sessions_that_have_not_ended(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let bob = store.user(&dn("Bob"), 20_000).await.unwrap();
    let first = create(&store, &alice.dn, Some("train1"), t(0)).await;
    let err = store
        .create_session(new_session(&alice.dn, Some("train1"), t(1)))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::NameTaken { name, state: SessionState::Pending } if name.as_str() == "train1"),
        "{err}"
    );
    // Another user may use the same name.
    create(&store, &bob.dn, Some("train1"), t(1)).await;
    // Once ended, the name is free again; lookups prefer the live session.
    moved(
        &store,
        first.id,
        change(SessionState::Ended, t(2), "removed", Placement::Keep),
    )
    .await;
    let second = create(&store, &alice.dn, Some("train1"), t(3)).await;
    let name = SessionName::parse("train1").unwrap();
    let found = store
        .session_by_name(&alice.dn, &name)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.id, second.id);
    moved(
        &store,
        second.id,
        change(SessionState::Ended, t(4), "removed", Placement::Keep),
    )
    .await;
    let found = store
        .session_by_name(&alice.dn, &name)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.id, second.id, "the last ended one when none is live");

    // Default names: dev, dev-2, ... filling the first gap.
    let mut ids = Vec::new();
    for (i, expected) in ["dev", "dev-2", "dev-3"].into_iter().enumerate() {
        let s = create(&store, &alice.dn, None, t(10 + i as i64)).await;
        assert_eq!(s.name.as_str(), expected);
        ids.push(s.id);
    }
    moved(
        &store,
        ids[1],
        change(SessionState::Ended, t(20), "removed", Placement::Keep),
    )
    .await;
    let refill = create(&store, &alice.dn, None, t(21)).await;
    assert_eq!(refill.name.as_str(), "dev-2");

    let mine = store
        .sessions(SessionFilter::Owner(alice.dn.clone()))
        .await
        .unwrap();
    let names: Vec<_> = mine.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["dev", "dev-3", "dev-2"],
        "ENDED sessions are not listed"
    );
    assert_eq!(store.sessions(SessionFilter::All).await.unwrap().len(), 4);

    // Only names of exactly that form take a number: `dev-1`, `dev-04`, `dev-4x`, `dev-0` and a
    // number of ten digits leave 4 free.
    for (i, name) in [
        "dev-1",
        "dev-04",
        "dev-4x",
        "dev-5",
        "dev-0",
        "dev-1234567890",
    ]
    .into_iter()
    .enumerate()
    {
        create(&store, &alice.dn, Some(name), t(30 + i as i64)).await;
    }
    for (i, expected) in ["dev-4", "dev-6", "dev-7"].into_iter().enumerate() {
        let s = create(&store, &alice.dn, None, t(40 + i as i64)).await;
        assert_eq!(s.name.as_str(), expected);
    }
    // Bob's sessions never take Alice's numbers.
    assert_eq!(
        create(&store, &bob.dn, None, t(50)).await.name.as_str(),
        "dev"
    );
    // Requests at once each get a name of their own, the first ones free: each looks for its
    // name before the write and finds it taken there but the first.
    let carol = store.user(&dn("Carol"), 20_000).await.unwrap();
    let made = futures::future::join_all(
        (0..5).map(|i| store.create_session(new_session(&carol.dn, None, t(60 + i)))),
    )
    .await;
    let mut names: Vec<String> = made
        .into_iter()
        .map(|made| made.unwrap().name.to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["dev", "dev-2", "dev-3", "dev-4", "dev-5"]);
}

/// Creates that wait together are written in one write (one change number for all): each still
/// gets its own answer. Of two asking for one name, one gets it and the other is refused; a
/// removed owner's create is refused and the others are stored; default names are counted with
/// the sessions written beside them, so none is given twice; every stored one has its first
/// transition and its limits.
async fn creates_written_together_each_keep_their_own_answer(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let [alice, bob, carol] = bob_removed(&store).await;
    create(&store, &carol.dn, None, t(0)).await;
    let limited = |owner: &Dn, name: Option<&str>, i: i64| NewSession {
        idle_timeout_secs: Some(600 + i as u64),
        max_duration_secs: Some(3_600),
        ..new_session(owner, name, t(10 + i))
    };
    let asked = [
        limited(&alice.dn, Some("x"), 0),
        limited(&alice.dn, Some("x"), 1),
        limited(&bob.dn, None, 2),
        limited(&alice.dn, None, 3),
        limited(&carol.dn, None, 4),
        limited(&alice.dn, None, 5),
        limited(&carol.dn, None, 6),
    ];
    let ids: Vec<SessionId> = asked.iter().map(|new| new.id).collect();
    // Each joins once it looked for its default name.
    let creating = asked.into_iter().map(|new| {
        let store = store.clone();
        async move { store.create_session(new).await }
    });
    let made = written_together(&store, Together::Creates, creating, async {}).await;
    let mut named: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut refused = Vec::new();
    for (i, made) in made.into_iter().enumerate() {
        match made {
            Ok(session) => {
                assert_eq!(session.id, ids[i]);
                let user = session.user_name.to_string();
                *named.entry((user, session.name.to_string())).or_default() += 1;
                let history = store.transitions(session.id).await.unwrap();
                assert_eq!(history.len(), 1, "{history:?}");
                assert_eq!(history[0].to, SessionState::Pending);
                let facts = store
                    .lifecycle_facts(FactsScope::Session(session.id))
                    .await
                    .unwrap();
                assert_eq!(facts[0].idle_timeout_secs, Some(600 + i as u64));
                assert_eq!(facts[0].max_duration_secs, Some(3_600));
            }
            Err(error) => refused.push((i, error)),
        }
    }
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(
        refused.iter().any(|(i, e)| *i < 2
            && matches!(e, StoreError::NameTaken { name, state: SessionState::Pending }
                if name.as_str() == "x")),
        "{refused:?}"
    );
    assert!(
        refused
            .iter()
            .any(|(i, e)| *i == 2 && matches!(e, StoreError::UserRemoved(who) if *who == bob.dn)),
        "{refused:?}"
    );
    let names: Vec<(String, String)> = named.keys().cloned().collect();
    let user = |u: &UserRecord, name: &str| (u.user_name.to_string(), name.to_owned());
    assert!(named.values().all(|&n| n == 1), "{named:?}");
    // Alice: `x` once and two default names; Carol's two after her `dev`.
    let mut stamps = BTreeSet::new();
    for id in &ids {
        let id = id.to_string();
        for row in store
            .rows(
                "SELECT CAST(change_seq AS TEXT) FROM sessions WHERE id = ?",
                &[&id],
            )
            .await
        {
            stamps.insert(row[0].clone());
        }
    }
    assert_eq!(stamps.len(), 1, "written in one write: {stamps:?}");
    let mut expected = vec![
        user(&alice, "dev"),
        user(&alice, "dev-2"),
        user(&alice, "x"),
        user(&carol, "dev-2"),
        user(&carol, "dev-3"),
    ];
    expected.sort();
    assert_eq!(names, expected);
    counts_match_the_tables(&store).await;
}

/// A write of creates takes the creates waiting once it has the site's write lock: those that
/// came while it waited for the lock are in it, not in a write after it.
async fn creates_that_come_while_a_write_waits_for_the_lock_go_in_it(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let lock = store.hold_write_lock().await;
    let send = |name: &str| {
        let (store, new) = (store.clone(), new_session(&alice.dn, Some(name), t(5)));
        tokio::spawn(async move { store.create_session(new).await })
    };
    let first = send("first");
    // Its write has the turn and waits for the lock.
    let joined = |count: usize| {
        let store = store.clone();
        async move {
            while !(store.turn_taken(Together::Creates)
                && store.waiting(Together::Creates) == count)
            {
                tokio::task::yield_now().await;
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), joined(1))
        .await
        .expect("the first create waits for the lock");
    let later = [send("second"), send("third")];
    tokio::time::timeout(std::time::Duration::from_secs(10), joined(3))
        .await
        .expect("the later creates wait beside the first, which was not taken yet");
    drop(lock);
    let mut stamps = BTreeSet::new();
    for sent in std::iter::once(first).chain(later) {
        let session = sent.await.unwrap().expect("created");
        let id = session.id.to_string();
        let rows = store
            .rows(
                "SELECT CAST(change_seq AS TEXT) FROM sessions WHERE id = ?",
                &[&id],
            )
            .await;
        stamps.insert(rows[0][0].clone());
    }
    assert_eq!(stamps.len(), 1, "written in one write: {stamps:?}");
}

/// A write made together runs on the store's thread of writes, not among the caller's tasks
/// (here the test's runtime, on the test's own thread).
async fn writes_made_together_run_on_the_thread_of_the_writes(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let caller = std::thread::current().name().map(str::to_owned);
    assert_ne!(caller.as_deref(), Some("store-writes"));
    assert_eq!(
        store.thread_of_writes().await.as_deref(),
        Some("store-writes")
    );
    // The next one too (the thread is started once).
    assert_eq!(
        store.thread_of_writes().await.as_deref(),
        Some("store-writes")
    );
}

async fn users_get_stable_unique_names_and_uids(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let a1 = store.user(&dn("Alice Smith"), 20_000).await.unwrap();
    let a2 = store
        .user(
            &Dn::parse("/DC=org/DC=other/CN=Alice Smith").unwrap(),
            20_000,
        )
        .await
        .unwrap();
    let a3 = store
        .user(&Dn::parse("/O=third/CN=Alice Smith").unwrap(), 20_000)
        .await
        .unwrap();
    assert_eq!((a1.user_name.as_str(), a1.uid), ("alice-smith", 20_000));
    assert_eq!((a2.user_name.as_str(), a2.uid), ("alice-smith-2", 20_001));
    assert_eq!((a3.user_name.as_str(), a3.uid), ("alice-smith-3", 20_002));
    // Asking again gives the same record, even with another first_uid.
    assert_eq!(store.user(&a2.dn, 30_000).await.unwrap(), a2);
    // A raised first_uid applies to new users.
    let bob = store.user(&dn("Bob"), 30_000).await.unwrap();
    assert_eq!(bob.uid, 30_000);
    let carol = store.user(&dn("Carol"), 20_000).await.unwrap();
    assert_eq!(carol.uid, 30_001);
    // With the accounting group last recorded, read together; a new user is made as by `user`.
    let (dave, group) = store.user_and_group(&dn("Dave"), 20_000).await.unwrap();
    assert_eq!(
        (dave.user_name.as_str(), dave.uid, group),
        ("dave", 30_002, None)
    );
    assert_eq!(store.user(&dave.dn, 20_000).await.unwrap(), dave);
    assert_eq!(
        store.user_and_group(&bob.dn, 20_000).await.unwrap(),
        (bob.clone(), None)
    );
    let atlas = crate::domain::policy::GroupName::parse("atlas").unwrap();
    store
        .set_accounting_group(&bob.dn, &atlas, t(0))
        .await
        .unwrap();
    assert_eq!(
        store.user_and_group(&bob.dn, 20_000).await.unwrap(),
        (bob, Some(atlas))
    );
}

/// The reservations requests use: those of the sessions that have not ended (an ended one's
/// row stays), none of a session never stored.
async fn request_reservations_are_those_of_sessions_not_ended(backend: Backend) {
    use crate::domain::policy::reservations::ReservationName;
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let course = ReservationName::parse("course").unwrap();
    let policy = store.gpu_policy();
    let first = new_session(&alice.dn, Some("a"), t(1));
    let second = new_session(&alice.dn, Some("b"), t(1));
    for id in [first.id, second.id, SessionId::new_random()] {
        policy.set_session_reservation(id, &course).await.unwrap();
    }
    let first = store.create_session(first).await.unwrap();
    let second = store.create_session(second).await.unwrap();
    moved(
        &store,
        first.id,
        change(SessionState::Ended, t(2), "removed", Placement::Keep),
    )
    .await;
    let requests = policy.request_reservations().await.unwrap();
    assert_eq!(
        requests.sessions.into_iter().collect::<Vec<_>>(),
        vec![(second.id, course)]
    );
    let rows = store
        .rows(
            "SELECT CAST(COUNT(*) AS TEXT) FROM session_reservations",
            &[],
        )
        .await;
    assert_eq!(rows[0][0].as_deref(), Some("3"));
}

/// Heartbeats that arrive while one is written are written together: each node at its own
/// time (the later one of a node that beat twice), each sync answered with when its node was
/// seen before; a node removed while its heartbeat waited is answered as not registered.
async fn heartbeats_written_together_each_keep_their_own_answer(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    for (name, gpu) in [("node1", gpu(1)), ("node2", gpu(2)), ("node3", gpu(3))] {
        register(&store, name, &[gpu], t(0)).await;
    }
    let beats = [
        ("node1", 1, 40),
        ("node2", 2, 41),
        ("node1", 1, 42),
        ("node3", 3, 43),
    ];
    let syncing = beats.into_iter().map(|(name, index, at)| {
        let store = store.clone();
        let node = NodeName::parse(name).unwrap();
        async move { store.record_sync(&node, &[gpu(index)], t(at)).await }
    });
    // node3 removed while its heartbeat waits.
    let removing = async {
        let node3 = NodeName::parse("node3").unwrap();
        let removal = store
            .remove_node(&node3, t(100), std::time::Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(removal, NodeRemoval::Removed);
    };
    let answers: Vec<_> = written_together(&store, Together::SyncRecords, syncing, removing)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let seen_at_registration = Some(Heartbeat {
        last_seen: t(0),
        gpus_changed: false,
    });
    assert_eq!(
        answers,
        [
            seen_at_registration,
            seen_at_registration,
            seen_at_registration,
            None
        ]
    );
    let seen: Vec<_> = store
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|node| (node.name.to_string(), node.last_seen))
        .collect();
    assert_eq!(
        seen,
        [("node1".to_owned(), t(42)), ("node2".to_owned(), t(41))]
    );
}

/// Activity samples of syncs that arrive while some are written are written together, each
/// session's as if its samples had been written one after the other: the last reading stored,
/// the last one at or above the threshold as its activity; a sample of a session that is not on
/// the node that sent it is not recorded; each sync is answered with how many of its were.
async fn activity_samples_written_together_each_keep_their_own_answer(backend: Backend) {
    use crate::domain::sessions::holds::{LifecycleConfig, Sampled};
    use ongrid_core::holds::ContainerActivity;

    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    register(&store, "node2", &[gpu(3)], t(0)).await;
    let mut placed = Vec::new();
    for (name, node, index) in [("a", "node1", 1), ("b", "node1", 2), ("c", "node2", 3)] {
        let session = create(&store, &alice.dn, Some(name), t(0)).await;
        let placement = Placement::Place {
            node: NodeName::parse(node).unwrap(),
            gpus: vec![GpuId::Gpu(gpu(index).uuid)],
        };
        let change = change(SessionState::Starting, t(1), "placed", placement);
        placed.push(moved(&store, session.id, change).await.id);
    }
    let [a, b, c] = placed[..] else {
        unreachable!("three sessions")
    };
    let sample = |session_id, cpu_percent, gpu_percent| ContainerActivity {
        session_id,
        sampled_at: t(5),
        cpu_percent,
        gpu_percent,
    };
    let syncs = [
        // c is not node1's: its sample from node1 is not recorded.
        (
            "node1",
            vec![
                sample(a, 90.0, Some(50.0)),
                sample(b, 1.0, None),
                sample(c, 90.0, None),
            ],
            t(10),
        ),
        ("node2", vec![sample(c, 2.0, Some(80.0))], t(11)),
        // a again, idle now: busy at t(10) stays its last activity.
        ("node1", vec![sample(a, 1.0, Some(0.0))], t(12)),
    ];
    let recording = syncs.into_iter().map(|(node, samples, at)| {
        let store = store.clone();
        let node = NodeName::parse(node).unwrap();
        async move {
            let lifecycle = LifecycleConfig::default();
            store.record_activity(&node, &samples, at, &lifecycle).await
        }
    });
    let answers: Vec<usize> = written_together(&store, Together::SyncRecords, recording, async {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(answers, [2, 1, 1]);
    let measured = |at: i64, percent: f64, active_at: Option<i64>| Sampled {
        sampled_at: Some(t(at)),
        percent: Some(percent),
        active_at: active_at.map(t),
    };
    for (id, cpu, gpu) in [
        (a, measured(12, 1.0, Some(10)), measured(12, 0.0, Some(10))),
        (b, measured(10, 1.0, None), Sampled::default()),
        (c, measured(11, 2.0, None), measured(11, 80.0, Some(11))),
    ] {
        let facts = store
            .lifecycle_facts(FactsScope::Session(id))
            .await
            .unwrap();
        assert_eq!((facts[0].cpu, facts[0].gpu), (cpu, gpu), "{id}");
    }
}

/// A session's samples are all recorded, but written only when the hold policy must see them:
/// the first, one that turned busy or idle, and otherwise one a minute (an eighth of the
/// session's idle timeout when that is shorter). The last activity of the readings not written
/// is written with the next one that is.
async fn activity_samples_are_written_when_the_hold_policy_must_see_them(backend: Backend) {
    use crate::domain::sessions::holds::{LifecycleConfig, Sampled};
    use ongrid_core::holds::ContainerActivity;

    let (place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    let node1 = NodeName::parse("node1").unwrap();
    let mut placed = Vec::new();
    // a: the site's idle timeout (2 hours); b: 40 seconds of its own.
    for (name, index, idle_timeout_secs) in [("a", 1, None), ("b", 2, Some(40))] {
        let new = NewSession {
            idle_timeout_secs,
            ..new_session(&alice.dn, Some(name), t(0))
        };
        let session = store.create_session(new).await.unwrap();
        let change = change(
            SessionState::Starting,
            t(1),
            "placed",
            on_node1(&gpu(index)),
        );
        placed.push(moved(&store, session.id, change).await.id);
    }
    let [a, b] = placed[..] else {
        unreachable!("two sessions")
    };
    let lifecycle = LifecycleConfig::default();
    let stored = |at: i64, percent: f64, active_at: Option<i64>| Sampled {
        sampled_at: Some(t(at)),
        percent: Some(percent),
        active_at: active_at.map(t),
    };
    // A second manager on the same database, as two replicas behind one address: each
    // remembers the activity it did not write, and a later one stored by the other stays.
    let other = place.open().await;
    let steps = [
        (a, 10, 1.0, stored(10, 1.0, None), "the first"),
        (a, 15, 2.0, stored(10, 1.0, None), "idle after idle waits"),
        (a, 20, 90.0, stored(20, 90.0, Some(20)), "turned busy"),
        (
            a,
            25,
            90.0,
            stored(20, 90.0, Some(20)),
            "busy after busy waits",
        ),
        (
            a,
            30,
            80.0,
            stored(20, 90.0, Some(20)),
            "busy after busy waits",
        ),
        (
            a,
            35,
            1.0,
            stored(35, 1.0, Some(30)),
            "turned idle, busy until 30",
        ),
        (
            a,
            95,
            1.0,
            stored(95, 1.0, Some(30)),
            "a minute after the stored one",
        ),
        (a, 100, 90.0, stored(100, 90.0, Some(100)), "turned busy"),
        (
            a,
            130,
            90.0,
            stored(100, 90.0, Some(100)),
            "busy after busy waits",
        ),
        (
            a,
            160,
            90.0,
            stored(160, 90.0, Some(160)),
            "a minute after the stored one",
        ),
        (b, 10, 90.0, stored(10, 90.0, Some(10)), "the first"),
        (
            b,
            14,
            90.0,
            stored(10, 90.0, Some(10)),
            "busy after busy waits",
        ),
        (
            b,
            15,
            90.0,
            stored(15, 90.0, Some(15)),
            "an eighth of its idle timeout",
        ),
    ]
    .map(|(id, at, percent, expected, why)| (&store, id, at, percent, expected, why));
    let replicas = [
        (
            &other,
            a,
            185,
            90.0,
            stored(160, 90.0, Some(160)),
            "busy after busy waits",
        ),
        (
            &store,
            a,
            190,
            90.0,
            stored(160, 90.0, Some(160)),
            "busy after busy waits",
        ),
        (
            &store,
            a,
            195,
            1.0,
            stored(195, 1.0, Some(190)),
            "turned idle, busy until 190",
        ),
        (
            &other,
            a,
            200,
            1.0,
            stored(195, 1.0, Some(190)),
            "idle after idle waits",
        ),
        (
            &other,
            a,
            255,
            1.0,
            stored(255, 1.0, Some(190)),
            "busy at 185 is older than 190",
        ),
    ];
    for (store, id, at, cpu_percent, expected, why) in steps.into_iter().chain(replicas) {
        let sample = ContainerActivity {
            session_id: id,
            sampled_at: t(at),
            cpu_percent,
            gpu_percent: None,
        };
        let recorded = store
            .record_activity(&node1, &[sample], t(at), &lifecycle)
            .await
            .unwrap();
        assert_eq!(recorded, 1, "{id} at {at}: {why}");
        let facts = store
            .lifecycle_facts(FactsScope::Session(id))
            .await
            .unwrap();
        assert_eq!(facts[0].cpu, expected, "{id} at {at}: {why}");
        assert_eq!(facts[0].gpu, Sampled::default(), "{id}: no GPU reading");
    }
    // A manager that stops writes the activity it did not write yet.
    for at in [260, 270] {
        let sample = ContainerActivity {
            session_id: a,
            sampled_at: t(at),
            cpu_percent: 90.0,
            gpu_percent: None,
        };
        let samples = [sample];
        let recorded = store.record_activity(&node1, &samples, t(at), &lifecycle);
        assert_eq!(recorded.await.unwrap(), 1);
    }
    let facts = other.lifecycle_facts(FactsScope::Session(a)).await.unwrap();
    assert_eq!(
        facts[0].cpu,
        stored(260, 90.0, Some(260)),
        "busy at 270 waits"
    );
    store.0.close().await;
    let facts = other.lifecycle_facts(FactsScope::Session(a)).await.unwrap();
    assert_eq!(
        facts[0].cpu,
        stored(260, 90.0, Some(270)),
        "written as it stopped"
    );
}

async fn nodes_keep_gpu_modes_and_mark_vanished_gpus_failed(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let node1 = NodeName::parse("node1").unwrap();
    assert_eq!(
        store.record_sync(&node1, &[gpu(1)], t(0)).await.unwrap(),
        None
    );
    register(&store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    let shared = GpuMode::Shared { max_sessions: 3 };
    let updated = store
        .set_gpu_mode(&gpu(1).uuid, shared)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(updated.mode, shared);
    let unknown = GpuUuid::parse("GPU-99999999-2222-3333-4444-555555555599").unwrap();
    assert_eq!(store.set_gpu_mode(&unknown, shared).await.unwrap(), None);

    // Re-registering keeps the admin's mode; GPU 2 is gone and shows as failed.
    let mut sick = gpu(1);
    sick.driver_version = Some("555.0".to_owned());
    register(&store, "node1", &[sick.clone()], t(5)).await;
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].last_seen, t(5));
    assert_eq!(nodes[0].gpus[0].mode, shared);
    assert_eq!(nodes[0].gpus[0].info, sick);
    assert_eq!(
        nodes[0].gpus[1].info.health,
        GpuHealth::Failed("no longer reported by node node1's agent".to_owned())
    );
    assert_eq!(nodes[0].gpus[1].mode, GpuMode::Exclusive);

    // A sync records health and the time, and says when the node was seen before it.
    sick.health = GpuHealth::Failed("fell off the bus".to_owned());
    let heartbeat = Heartbeat {
        last_seen: t(5),
        gpus_changed: true,
    };
    let synced = store
        .record_sync(&node1, &[sick.clone(), gpu(2)], t(9))
        .await
        .unwrap();
    assert_eq!(synced, Some(heartbeat));
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes[0].last_seen, t(9));
    assert_eq!(nodes[0].gpus[0].info.health, sick.health);
    assert!(nodes[0].gpus[1].info.health.is_healthy());

    // The same report again changes no GPU; a new utilisation is stored but is no change for
    // the scheduler; a MIG device is one.
    let synced = store
        .record_sync(&node1, &[sick.clone(), gpu(2)], t(10))
        .await
        .unwrap();
    let unchanged = |last_seen| {
        Some(Heartbeat {
            last_seen,
            gpus_changed: false,
        })
    };
    assert_eq!(synced, unchanged(t(9)));
    let busy = GpuInfo {
        utilization_percent: Some(87),
        ..gpu(2)
    };
    let synced = store
        .record_sync(&node1, &[sick.clone(), busy.clone()], t(11))
        .await
        .unwrap();
    assert_eq!(synced, unchanged(t(10)));
    assert_eq!(store.nodes().await.unwrap()[0].gpus[1].info, busy);
    let mut mig = busy.clone();
    mig.mig_waiting = Some(ongrid_core::mig::MigChange::Off);
    let synced = store
        .record_sync(&node1, &[sick.clone(), mig.clone()], t(12))
        .await
        .unwrap();
    assert!(synced.is_some_and(|heartbeat| heartbeat.gpus_changed));

    // One node read alone is the same record, its GPUs in the same order; another node's GPUs
    // are not among them, and an unknown node is none.
    register(&store, "node0", &[gpu(3)], t(9)).await;
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes.len(), 2);
    assert_eq!(store.node(&node1).await.unwrap().as_ref(), Some(&nodes[1]));
    let node0 = store.node(&nodes[0].name).await.unwrap().unwrap();
    assert_eq!(node0.gpus.len(), 1);
    assert_eq!(node0, nodes[0]);
    let unknown = NodeName::parse("node9").unwrap();
    assert_eq!(store.node(&unknown).await.unwrap(), None);
}

async fn the_queue_is_ordered_by_time_then_id(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let late = create(&store, &alice.dn, Some("late"), t(10)).await;
    let early = create(&store, &alice.dn, Some("early"), t(1)).await;
    let mut same_a = new_session(&alice.dn, Some("same-a"), t(5));
    let mut same_b = new_session(&alice.dn, Some("same-b"), t(5));
    same_a.id = SessionId("00000000-0000-4000-8000-000000000002".parse().unwrap());
    same_b.id = SessionId("00000000-0000-4000-8000-000000000001".parse().unwrap());
    store.create_session(same_a.clone()).await.unwrap();
    store.create_session(same_b.clone()).await.unwrap();
    let order = vec![early.id, same_b.id, same_a.id, late.id];
    assert_eq!(store.pending_order().await.unwrap(), order);
    // One session's place, counted, is its place in that order; a session not waiting has none.
    for (place, id) in (1..).zip(&order) {
        assert_eq!(store.pending_place(*id).await.unwrap(), Some(place), "{id}");
    }
    assert_eq!(
        store.pending_place(SessionId::new_random()).await.unwrap(),
        None
    );
    // Read again after changes: one that ended has left the queue, the ones behind it moved up,
    // and one created since queues by its time.
    let end = Change::keep_placement(SessionState::Ended, t(11), "removed by alice");
    store.transition(same_b.id, end).await.unwrap();
    let middle = create(&store, &alice.dn, Some("middle"), t(7)).await;
    let order = vec![early.id, same_a.id, middle.id, late.id];
    assert_eq!(store.pending_order().await.unwrap(), order);
    for (place, id) in (1..).zip(&order) {
        assert_eq!(store.pending_place(*id).await.unwrap(), Some(place), "{id}");
    }
    assert_eq!(store.pending_place(same_b.id).await.unwrap(), None);
    let end = Change::keep_placement(SessionState::Ended, t(12), "removed by alice");
    store.transition(middle.id, end).await.unwrap();
    let pending = store
        .sessions(SessionFilter::States(vec![SessionState::Pending]))
        .await
        .unwrap();
    assert_eq!(pending.len(), 3);
    assert!(store
        .sessions(SessionFilter::States(vec![SessionState::Starting]))
        .await
        .unwrap()
        .is_empty());
}

async fn concurrent_writers_do_not_fail(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let owners: Vec<Dn> = (0..8).map(|i| dn(&format!("User {i}"))).collect();
    let tasks: Vec<_> = owners
        .iter()
        .map(|owner| {
            let store = store.clone();
            let owner = owner.clone();
            tokio::spawn(async move {
                store.user(&owner, 20_000).await.unwrap();
                for _ in 0..3 {
                    create(&store, &owner, None, t(0)).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(store.sessions(SessionFilter::All).await.unwrap().len(), 24);
    let uids: BTreeSet<u32> = {
        let mut uids = BTreeSet::new();
        for owner in &owners {
            uids.insert(store.user(owner, 20_000).await.unwrap().uid);
        }
        uids
    };
    assert_eq!(uids, (20_000..20_008).collect());
}

fn new_key(owner: &Dn, n: u8, at: DateTime<Utc>, expires_at: DateTime<Utc>) -> NewKey {
    NewKey {
        fingerprint: format!("SHA256:key{n}"),
        owner: owner.clone(),
        algorithm: "ssh-ed25519".to_owned(),
        public_key: format!("ssh-ed25519 AAAA{n}"),
        comment: format!("key {n}"),
        at,
        expires_at,
        fqans: vec!["/atlas/Role=NULL/Capability=NULL".to_owned()],
        token_issuer: None,
    }
}

/// Adds (or renews) `owner`'s key `n` of [`new_key`], at most `max` keys per owner.
async fn add_key(
    store: &TestStore,
    owner: &Dn,
    n: u8,
    at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    max: usize,
) -> KeyAdded {
    let key = new_key(owner, n, at, expires_at);
    store.add_key(key, max).await.unwrap()
}

async fn keys_belong_to_one_owner_and_renew(backend: Backend) {
    let (place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let bob = store.user(&dn("Bob"), 20_000).await.unwrap();

    let added = add_key(&store, &alice.dn, 1, t(0), t(100), 2).await;
    let KeyAdded::New(first) = added else {
        panic!("a new key: {added:?}")
    };
    assert_eq!(first.user_name, alice.user_name);
    assert_eq!((first.added_at, first.expires_at), (t(0), t(100)));
    assert_eq!(
        first.fqans,
        Some(vec!["/atlas/Role=NULL/Capability=NULL".to_owned()])
    );

    // The same key again from its owner: renewed, added_at kept, comment, expiry and the
    // credential's FQANs new.
    let mut again = new_key(&alice.dn, 1, t(50), t(200));
    again.comment = "renamed".to_owned();
    again.fqans = vec!["/cms/Role=gpu/Capability=NULL".to_owned()];
    let renewed = store.add_key(again, 2).await.unwrap();
    let KeyAdded::Renewed(renewed) = renewed else {
        panic!("a renewal: {renewed:?}")
    };
    assert_eq!(
        (
            renewed.added_at,
            renewed.expires_at,
            renewed.comment.as_str()
        ),
        (t(0), t(200), "renamed")
    );
    assert_eq!(
        renewed.fqans,
        Some(vec!["/cms/Role=gpu/Capability=NULL".to_owned()])
    );

    // Someone else's key is refused, whoever asks.
    let err = store
        .add_key(new_key(&bob.dn, 1, t(60), t(300)), 2)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::KeyTaken { fingerprint } if fingerprint == "SHA256:key1"),
        "{err}"
    );

    // The limit counts the owner's keys; renewing at the limit still works.
    add_key(&store, &alice.dn, 2, t(1), t(100), 2).await;
    let err = store
        .add_key(new_key(&alice.dn, 3, t(2), t(100)), 2)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::TooManyKeys { max: 2 }), "{err}");
    assert!(matches!(
        add_key(&store, &alice.dn, 2, t(3), t(400), 2).await,
        KeyAdded::Renewed(_)
    ));
    add_key(&store, &bob.dn, 3, t(2), t(100), 2).await;

    let fingerprints =
        |keys: Vec<KeyRecord>| -> Vec<String> { keys.into_iter().map(|k| k.fingerprint).collect() };
    assert_eq!(
        fingerprints(store.keys(Some(&alice.dn)).await.unwrap()),
        ["SHA256:key1", "SHA256:key2"]
    );
    assert_eq!(store.keys(None).await.unwrap().len(), 3);
    assert_eq!(
        store.key("SHA256:key3").await.unwrap().unwrap().owner,
        bob.dn
    );
    assert_eq!(store.key("SHA256:nope").await.unwrap(), None);

    // Removal: only the owner's own, or any without an owner (admins).
    assert_eq!(
        store
            .remove_key("SHA256:key3", Some(&alice.dn))
            .await
            .unwrap(),
        None
    );
    assert!(store.key("SHA256:key3").await.unwrap().is_some());
    let removed = store
        .remove_key("SHA256:key1", Some(&alice.dn))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(removed.expires_at, t(200));
    assert!(store
        .remove_key("SHA256:key3", None)
        .await
        .unwrap()
        .is_some());
    assert_eq!(store.remove_key("SHA256:key3", None).await.unwrap(), None);
    let before = store.keys(None).await.unwrap();
    store.close().await;
    let store = place.open().await;
    assert_eq!(store.keys(None).await.unwrap(), before);
    assert_eq!(fingerprints(before), ["SHA256:key2"]);
}

async fn institutes_keep_their_networks(backend: Backend) {
    let (place, store) = Place::opened(backend).await;
    let institute = |name: &str, cidrs: &[&str]| Institute {
        name: InstituteName::parse(name).unwrap(),
        cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
    };
    let lab = institute("uni-lab", &["10.5.0.0/16", "2001:db8::/32"]);
    let cern = institute("cern.ch", &["192.0.2.0/24"]);
    store.add_institute(&lab, t(0)).await.unwrap();
    store.add_institute(&cern, t(1)).await.unwrap();
    let err = store
        .add_institute(&institute("uni-lab", &["10.9.0.0/16"]), t(2))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::InstituteExists(name) if name == &lab.name),
        "{err}"
    );
    assert_eq!(
        store.institutes().await.unwrap(),
        vec![cern.clone(), lab.clone()]
    );
    assert_eq!(store.institute(&lab.name).await.unwrap(), Some(lab.clone()));
    assert_eq!(
        store.remove_institute(&cern.name).await.unwrap(),
        Some(cern.clone())
    );
    assert_eq!(store.remove_institute(&cern.name).await.unwrap(), None);
    assert_eq!(store.institute(&cern.name).await.unwrap(), None);
    store.close().await;
    let store = place.open().await;
    assert_eq!(store.institutes().await.unwrap(), vec![lab]);
}

fn connection(
    session: &SessionRecord,
    n: u128,
    kind: ongrid_core::api::ConnectionEventKind,
    at: DateTime<Utc>,
    bytes: (u64, u64),
) -> ConnectionEvent {
    ConnectionEvent {
        connection_id: uuid::Uuid::from_u128(n),
        event: kind,
        at,
        owner: session.owner.clone(),
        fingerprint: "SHA256:key1".to_owned(),
        source: "::ffff:192.0.2.7".parse().unwrap(),
        institute: InstituteName::parse("uni-lab").unwrap(),
        session_id: session.id,
        bytes_in: bytes.0,
        bytes_out: bytes.1,
        close_reason: None,
    }
}

/// Records the event `kind` of connection `n` to `session` at `at`, when it happened.
async fn connection_event(
    store: &TestStore,
    session: &SessionRecord,
    n: u128,
    kind: ongrid_core::api::ConnectionEventKind,
    at: DateTime<Utc>,
    bytes: (u64, u64),
) -> ConnectionRecorded {
    let event = connection(session, n, kind, at, bytes);
    store.record_connection(&event, at).await.unwrap()
}

/// A WAITING session of `owner` named `name` on node1.
async fn running_session(store: &TestStore, owner: &Dn, name: &str) -> SessionRecord {
    register(store, "node1", &[gpu(1)], t(0)).await;
    let session = create(store, owner, Some(name), t(0)).await;
    let placement = on_node1(&gpu(1));
    let placed = change(SessionState::Starting, t(1), "placed", placement);
    moved(store, session.id, placed).await;
    let running = change(SessionState::Waiting, t(2), "running", Placement::Keep);
    moved(store, session.id, running).await
}

async fn connections_coming_and_going_leave_a_bounded_history(backend: Backend) {
    use ongrid_core::api::ConnectionEventKind::{Close, Open};
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let session = running_session(&store, &alice.dn, "train1").await;
    let at = |n: u32| t(10 + i64::from(n));
    for n in 0..500u32 {
        let id = u128::from(n);
        let opened = connection_event(&store, &session, id, Open, at(2 * n), (0, 0)).await;
        assert_eq!(opened.session.state, SessionState::Connected);
        let closed = connection_event(&store, &session, id, Close, at(2 * n + 1), (1, 1)).await;
        assert_eq!(closed.session.state, SessionState::Idle);
        assert!(
            closed.transition.is_some(),
            "each close still moves the session"
        );
    }
    let history = store.transitions(session.id).await.unwrap();
    let moves: Vec<_> = history.iter().map(|t| (t.from, t.to)).collect();
    use SessionState::*;
    assert_eq!(
        moves,
        [
            (None, Pending),
            (Some(Pending), Starting),
            (Some(Starting), Waiting),
            (Some(Waiting), Connected),
            (Some(Connected), Idle),
        ]
    );
    // The first connection as it was; the closes counted, the latest shown.
    assert_eq!(history[3].at, at(0));
    assert_eq!(history[3].reason, "SSH connection from 192.0.2.7 (uni-lab)");
    assert_eq!(history[4].at, at(999));
    assert_eq!(
        history[4].reason,
        "last SSH connection closed (500 times, the latest shown)"
    );
    // The session shows it too: IDLE since the latest close.
    let facts = store
        .lifecycle_facts(crate::store::FactsScope::Session(session.id))
        .await
        .unwrap();
    assert_eq!(facts[0].state_since, at(999));

    // Connected again: the latest open is a row of its own, and the history still replays
    // into a valid sequence that later moves (a hold) extend; the numbering has no gap.
    connection_event(&store, &session, 1000, Open, at(1000), (0, 0)).await;
    let history = store.transitions(session.id).await.unwrap();
    assert_eq!(history.len(), 6);
    assert_eq!(
        (history[5].from, history[5].to, history[5].at),
        (Some(Idle), Connected, at(1000))
    );
    store
        .transition(session.id, change(Held, at(1001), "owner", Placement::Keep))
        .await
        .unwrap();
    assert_eq!(store.transitions(session.id).await.unwrap().len(), 7);
    let seqs: Vec<i64> = store
        .rows(
            "SELECT CAST(seq AS TEXT) FROM session_transitions WHERE session_id = ? ORDER BY seq",
            &[&session.id.to_string()],
        )
        .await
        .iter()
        .map(|row| row[0].as_deref().unwrap().parse().unwrap())
        .collect();
    assert_eq!(seqs, (0..7).collect::<Vec<i64>>());
}

async fn connections_are_audited_and_move_their_session(backend: Backend) {
    use ongrid_core::api::ConnectionEventKind::{Close, Open};
    let (place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let bob = store.user(&dn("Bob"), 20_000).await.unwrap();
    let session = running_session(&store, &alice.dn, "train1").await;

    let record = |event: ConnectionEvent| {
        let store = store.clone();
        async move { store.record_connection(&event, t(99)).await.unwrap() }
    };
    let first = record(connection(&session, 1, Open, t(10), (0, 0))).await;
    assert_eq!(first.open_connections, 1);
    assert_eq!(first.session.state, SessionState::Connected);
    let transition = first.transition.unwrap();
    assert_eq!(
        (transition.from, transition.at, transition.reason.as_str()),
        (
            Some(SessionState::Waiting),
            t(99),
            "SSH connection from 192.0.2.7 (uni-lab)"
        )
    );
    // A second connection, and a retried open, change nothing.
    let second = record(connection(&session, 2, Open, t(11), (0, 0))).await;
    assert_eq!((second.open_connections, second.transition), (2, None));
    let retried = record(connection(&session, 2, Open, t(12), (0, 0))).await;
    assert_eq!((retried.open_connections, retried.transition), (2, None));
    // Closing one of two keeps it CONNECTED; closing the last makes it IDLE.
    let closed = record(connection(&session, 1, Close, t(20), (100, 2000))).await;
    assert_eq!(closed.open_connections, 1);
    assert_eq!(closed.session.state, SessionState::Connected);
    // The gateway closed this one itself: the reason stays in the audit log.
    let revoked = "your SSH key SHA256:key1 was removed at 2026-11-21 10:00:00 UTC: run `devctl key add` to register a key again";
    let last = record(ConnectionEvent {
        close_reason: Some(revoked.to_owned()),
        ..connection(&session, 2, Close, t(21), (5, 6))
    })
    .await;
    assert_eq!(last.open_connections, 0);
    assert_eq!(last.session.state, SessionState::Idle);
    assert_eq!(last.session.reason, "last SSH connection closed");
    // A new connection makes it CONNECTED again; a close never opened is recorded whole.
    let third = record(connection(&session, 3, Open, t(30), (0, 0))).await;
    assert_eq!(third.session.state, SessionState::Connected);
    let orphan = record(connection(&session, 4, Close, t(31), (7, 8))).await;
    assert_eq!((orphan.open_connections, orphan.transition), (1, None));

    let bobs = running_session(&store, &bob.dn, "bobs").await;
    record(connection(&bobs, 5, Open, t(40), (0, 0))).await;

    let all = |owner: Option<&Dn>, since: Option<DateTime<Utc>>, limit: u32| {
        let store = store.clone();
        let filter = AuditFilter {
            owner: owner.cloned(),
            since,
            limit,
        };
        async move { store.audit(filter).await.unwrap() }
    };
    let log = all(None, None, 1000).await;
    let ids: Vec<u128> = log.iter().map(|r| r.connection_id.as_u128()).collect();
    assert_eq!(ids, [5, 4, 3, 2, 1], "newest first");
    let first_row = &log[4];
    assert_eq!(first_row.source.to_string(), "192.0.2.7", "normalised");
    assert_eq!(first_row.session_name.as_str(), "train1");
    assert_eq!(first_row.institute.as_str(), "uni-lab");
    assert_eq!(
        (first_row.opened_at, first_row.closed_at),
        (t(10), Some(t(20)))
    );
    assert_eq!((first_row.bytes_in, first_row.bytes_out), (100, 2000));
    assert_eq!(first_row.close_reason, None);
    assert_eq!(log[3].close_reason.as_deref(), Some(revoked));
    let orphan_row = &log[1];
    assert_eq!(
        (orphan_row.opened_at, orphan_row.closed_at),
        (t(31), Some(t(31)))
    );
    assert_eq!(log[2].closed_at, None);
    assert_eq!(all(Some(&bob.dn), None, 1000).await.len(), 1);
    // Since: still open, or closed at or after it.
    let since: Vec<u128> = all(Some(&alice.dn), Some(t(21)), 1000)
        .await
        .iter()
        .map(|r| r.connection_id.as_u128())
        .collect();
    assert_eq!(since, [4, 3, 2]);
    assert_eq!(all(None, None, 2).await.len(), 2);

    // After a restart the open connections are counted from the table.
    store.close().await;
    let store = place.open().await;
    let after = store
        .record_connection(&connection(&session, 3, Close, t(50), (1, 1)), t(99))
        .await
        .unwrap();
    assert_eq!(after.open_connections, 0);
    assert_eq!(after.session.state, SessionState::Idle);

    let missing = SessionId::new_random();
    let mut event = connection(&session, 9, Open, t(60), (0, 0));
    event.session_id = missing;
    assert!(matches!(
        store.record_connection(&event, t(99)).await,
        Err(StoreError::NoSuchSession(id)) if id == missing
    ));
}

async fn nodes_keep_their_stream_url(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let mut node1 = registration("node1");
    node1.stream_url = Some("wss://node1.site.invalid:8444".to_owned());
    store.register_node(node1, &[gpu(1)], t(0)).await.unwrap();
    let nodes = store.nodes().await.unwrap();
    assert_eq!(
        nodes[0].stream_url.as_deref(),
        Some("wss://node1.site.invalid:8444")
    );
    // An agent whose [streams] was removed registers without one: cleared.
    register(&store, "node1", &[gpu(1)], t(1)).await;
    assert_eq!(store.nodes().await.unwrap()[0].stream_url, None);
}

/// A database of the release before typed hold reasons (migrations up to 0005) with held
/// sessions: the upgrade moves each hold's reason into its column and shows the same sentence.
async fn an_upgrade_types_the_hold_reasons_already_stored(backend: Backend) {
    let place = Place::new(backend).await;
    let idle = SessionId::new_random();
    let by_hand = SessionId::new_random();
    let request = serde_json::to_string(&GpuRequest::default()).unwrap();
    let idle_reason = "idle: no SSH connection and no activity for 2 hours";
    let statements = [
        format!(
            "INSERT INTO users VALUES ('/DC=org/CN=Alice', 'alice', 20000, '{}')",
            stored_time(t(0))
        ),
        format!(
            "INSERT INTO sessions VALUES ('{idle}', 'dev', '/DC=org/CN=Alice', '{request}', \
             'ongrid/dev:latest', 'HELD', '{idle_reason}', NULL, '[]', '{0}', '{0}', NULL), \
             ('{by_hand}', 'dev-2', '/DC=org/CN=Alice', '{request}', 'ongrid/dev:latest', \
             'HELD', 'idle for 20 minutes', NULL, '[]', '{0}', '{0}', NULL)",
            stored_time(t(0))
        ),
        format!(
            "INSERT INTO session_transitions VALUES \
             ('{idle}', 0, NULL, 'PENDING', '{0}', 'created'), \
             ('{idle}', 1, 'PENDING', 'STARTING', '{0}', 'placed'), \
             ('{idle}', 2, 'STARTING', 'WAITING', '{0}', 'running'), \
             ('{idle}', 3, 'WAITING', 'HELD', '{1}', 'owner: held by alice'), \
             ('{idle}', 4, 'HELD', 'PENDING', '{1}', 'released by alice'), \
             ('{idle}', 5, 'PENDING', 'STARTING', '{1}', 'placed'), \
             ('{idle}', 6, 'STARTING', 'WAITING', '{1}', 'running'), \
             ('{idle}', 7, 'WAITING', 'HELD', '{1}', '{idle_reason}'), \
             ('{by_hand}', 0, NULL, 'PENDING', '{0}', 'created'), \
             ('{by_hand}', 1, 'PENDING', 'STARTING', '{0}', 'placed'), \
             ('{by_hand}', 2, 'STARTING', 'WAITING', '{0}', 'running'), \
             ('{by_hand}', 3, 'WAITING', 'HELD', '{1}', 'idle for 20 minutes')",
            stored_time(t(0)),
            stored_time(t(5))
        ),
    ];
    place.old_schema_with("0006", &statements).await;

    let store = place.open().await;
    let session = store.session(idle).await.unwrap().unwrap();
    assert_eq!(session.reason, idle_reason, "the same sentence");
    let reasons: Vec<String> = store
        .transitions(idle)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.reason)
        .collect();
    assert_eq!(reasons[3], "owner: held by alice");
    assert_eq!(reasons[7], idle_reason);
    let untyped = store.session(by_hand).await.unwrap().unwrap();
    assert_eq!(untyped.reason, "idle for 20 minutes");
    // The columns hold the typed reason and the details apart.
    let stored = store
        .rows(
            "SELECT session_id, hold_reason, reason FROM session_transitions \
             WHERE to_state = 'HELD' ORDER BY session_id, seq",
            &[],
        )
        .await;
    let idle_rows: Vec<(Option<&str>, &str)> = stored
        .iter()
        .filter(|row| row[0].as_deref() == Some(idle.to_string().as_str()))
        .map(|row| (row[1].as_deref(), row[2].as_deref().unwrap()))
        .collect();
    assert_eq!(
        idle_rows,
        [
            (Some("owner"), "held by alice"),
            (
                Some("idle"),
                "no SSH connection and no activity for 2 hours"
            )
        ]
    );
    let row = store
        .rows(
            "SELECT hold_reason, reason FROM sessions WHERE id = ?",
            &[&by_hand.to_string()],
        )
        .await;
    assert_eq!(
        (row[0][0].as_deref(), row[0][1].as_deref()),
        (None, Some("idle for 20 minutes"))
    );
}

async fn a_hold_is_stored_typed_and_read_as_its_sentence(backend: Backend) {
    use ongrid_core::holds::HoldReason;
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let session = running_session(&store, &alice.dn, "train1").await;
    let hold = Change::hold(HoldReason::Admin, t(5), "maintenance (held by root)");
    let held = store.transition(session.id, hold).await.unwrap();
    assert_eq!(held.reason, "admin: maintenance (held by root)");
    let last = store.transitions(session.id).await.unwrap().pop().unwrap();
    assert_eq!(last.reason, "admin: maintenance (held by root)");
    let row = store
        .rows(
            "SELECT hold_reason, reason FROM sessions WHERE id = ?",
            &[&session.id.to_string()],
        )
        .await;
    assert_eq!(
        (row[0][0].as_deref(), row[0][1].as_deref()),
        (Some("admin"), Some("maintenance (held by root)"))
    );
    // Released: the typed reason goes with the hold.
    let released = moved(
        &store,
        session.id,
        Change::keep_placement(SessionState::Pending, t(6), "released by alice"),
    )
    .await;
    assert_eq!(released.reason, "released by alice");
    let row = store
        .rows(
            "SELECT hold_reason FROM sessions WHERE id = ?",
            &[&session.id.to_string()],
        )
        .await;
    assert_eq!(row, [[None]]);
}

/// Two schedulers (two tasks here, two manager replicas on one PostgreSQL) placing the same
/// PENDING session at once: the store replays its history inside the write, so exactly one
/// placement is stored and every other one is refused as an invalid transition.
async fn concurrent_placements_of_one_session_store_one(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let gpus: Vec<GpuInfo> = (1..=8).map(gpu).collect();
    register(&store, "node1", &gpus, t(0)).await;
    let session = create(&store, &alice.dn, Some("train1"), t(0)).await;
    let tasks: Vec<_> = gpus
        .iter()
        .map(|gpu| {
            let store = store.clone();
            let placement = on_node1(gpu);
            tokio::spawn(async move {
                store
                    .transition(
                        session.id,
                        change(SessionState::Starting, t(1), "placed", placement),
                    )
                    .await
            })
        })
        .collect();
    let mut placed = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok(record) => placed.push(record.gpus),
            Err(StoreError::InvalidTransition(e)) => assert_eq!(e.from, SessionState::Starting),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(placed.len(), 1, "{placed:?}");
    let stored = store.session(session.id).await.unwrap().unwrap();
    assert_eq!(stored.gpus, placed[0]);
    assert_eq!(store.transitions(session.id).await.unwrap().len(), 2);
}

/// Two managers on one PostgreSQL database: the second waits for the manager lock while the
/// first leads, and gets it as soon as the first one's lock connection ends (as when its process
/// dies); the first one notices that it lost the lock.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_follower_takes_the_lock_as_soon_as_the_leader_dies() {
    use std::time::{Duration, Instant};

    use crate::store::postgres::active::{PING_INTERVAL, PING_TIMEOUT};

    let place = Place::new(Backend::Postgres).await;
    let first = place.database.open().await.unwrap();
    let second = place.database.open().await.unwrap();
    let (Some(first), Some(second)) = (first.postgres().cloned(), second.postgres().cloned())
    else {
        panic!("{first:?} {second:?}")
    };
    let mut active = first
        .activate(|| panic!("nobody else leads yet"))
        .await
        .unwrap();
    let pid = active.backend_pid().await;

    let (waiting, standing_by) = tokio::sync::oneshot::channel();
    let mut standby = tokio::spawn(async move {
        let active = second
            .activate(move || waiting.send(()).unwrap())
            .await
            .unwrap();
        (Instant::now(), active)
    });
    standing_by.await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut standby)
            .await
            .is_err(),
        "two managers lead at once"
    );

    let killed_at = Instant::now();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(first.pool())
        .await
        .unwrap();
    assert!(ended);
    let (took_over_at, _active) = tokio::time::timeout(Duration::from_secs(5), standby)
        .await
        .expect("the follower did not take the lock within 5 s")
        .unwrap();
    let handover = took_over_at - killed_at;
    assert!(
        handover < Duration::from_secs(1),
        "handover took {handover:?}"
    );

    let why = tokio::time::timeout(
        PING_INTERVAL + PING_TIMEOUT + Duration::from_secs(1),
        active.lost(),
    )
    .await
    .expect("the first manager did not notice");
    assert!(why.contains("failed"), "{why}");
}

/// Replicas tell each other on PostgreSQL's LISTEN/NOTIFY: what one publishes reaches another's
/// listener, in order, and a listener whose connection was ended says so, then hears again.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn what_one_replica_publishes_another_hears() {
    use std::time::Duration;

    let place = Place::new(Backend::Postgres).await;
    let one = place.database.open().await.unwrap();
    let other = place.database.open().await.unwrap();
    let (Some(one), Some(other)) = (one.postgres(), other.postgres()) else {
        panic!("{one:?} {other:?}")
    };
    let mut listener = other.listen().await.unwrap();
    let said = ["r1 node gpu-1".to_owned(), "r1 site".to_owned()];
    one.publish(&said).await.unwrap();
    let mut heard = Vec::new();
    while heard.len() < 2 {
        let payload = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("nothing heard within 5 s")
            .unwrap();
        heard.extend(payload);
    }
    assert_eq!(heard, said);

    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .execute(one.pool())
    .await
    .unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("the ended connection was not noticed within 5 s")
        .unwrap();
    assert_eq!(lost, None);
    // The next call listens again.
    let again = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(10), listener.recv()).await
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        one.publish(&["r1 sessions".to_owned()]).await.unwrap();
        if again.is_finished() || std::time::Instant::now() > deadline {
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let heard = again
        .await
        .unwrap()
        .expect("nothing heard after listening again");
    assert_eq!(heard.unwrap().as_deref(), Some("r1 sessions"));
}

/// The dashboard's logins: a link is used once, and neither a link nor a login outlives its end.
async fn a_dashboard_link_is_used_once_and_not_after_it_expired(backend: Backend) {
    use chrono::TimeDelta;
    use ongrid_core::api::CredentialKind;

    let (_place, opened) = Place::opened(backend).await;
    let store = opened.dashboard();
    let now = Utc::now();
    let who = DashboardIdentity {
        dn: Dn::parse("/DC=org/CN=Alice").expect("dn"),
        fqans: vec!["/vo/Role=admin/Capability=NULL".to_owned()],
        kind: CredentialKind::Impersonation,
        not_after: now + TimeDelta::hours(12),
    };
    let later = now + TimeDelta::minutes(5);
    store
        .create_dashboard_link("a", &who, now, later)
        .await
        .expect("link");
    store
        .create_dashboard_link("b", &who, now, later)
        .await
        .expect("link");
    assert_eq!(
        store.dashboard_link("a", now).await.expect("peek"),
        Some(who.clone())
    );
    assert_eq!(
        store.redeem_dashboard_link("a", now).await.expect("use"),
        Some(who.clone())
    );
    assert_eq!(
        store.redeem_dashboard_link("a", now).await.expect("again"),
        None
    );
    assert_eq!(store.dashboard_link("a", now).await.expect("peek"), None);
    let expired = later + TimeDelta::seconds(1);
    assert_eq!(
        store
            .redeem_dashboard_link("b", expired)
            .await
            .expect("late"),
        None
    );

    let login = DashboardLogin {
        identity: DashboardIdentity {
            not_after: now + TimeDelta::hours(1),
            ..who
        },
        csrf_token: "csrf".to_owned(),
        expires_at: now + TimeDelta::hours(1),
    };
    store
        .create_dashboard_login("cookie", &login, now)
        .await
        .expect("login");
    assert_eq!(
        store.dashboard_login("cookie", now).await.expect("read"),
        Some(login.clone())
    );
    assert_eq!(
        store
            .dashboard_login("cookie", now + TimeDelta::hours(2))
            .await
            .expect("read"),
        None
    );
    store.end_dashboard_login("cookie").await.expect("end");
    assert_eq!(
        store.dashboard_login("cookie", now).await.expect("read"),
        None
    );
}

/// A job's restart chain: its history, its exit code, the next job linked and pinned.
async fn a_restart_chain_is_stored_with_its_history_and_links(backend: Backend) {
    use crate::domain::jobs;
    use ongrid_core::job::{JobReason, JobState, HALT_EXIT_CODE};

    let (_place, store) = Place::opened(backend).await;
    let dn = Dn::parse("/CN=Alice").unwrap();
    let node = NodeName::parse("node1").unwrap();
    register(&store, "node1", &[gpu(1)], t(0)).await;
    let job = queued_job(&store, t(1), None).await;
    assert_eq!(job.state(), JobState::Queued);
    assert_eq!(job.queued_at(), t(1));
    assert_eq!(
        store.jobs(JobFilter::Active).await.unwrap(),
        std::slice::from_ref(&job)
    );

    let gpus = vec![GpuId::from(gpu(1).uuid)];
    let started = jobs::start(&job, node.clone(), gpus.clone(), t(2)).unwrap();
    let job = store.job_transition(job.id, started, None).await.unwrap();
    assert_eq!(
        (job.state(), &job.node, &job.gpus),
        (JobState::Running, &Some(node.clone()), &gpus)
    );
    assert_eq!(
        store
            .jobs(JobFilter::Node(node.clone()))
            .await
            .unwrap()
            .len(),
        1
    );
    // A stale decision is refused by the state machine.
    let again = jobs::start(
        &store.job(job.id).await.unwrap().unwrap(),
        node.clone(),
        gpus,
        t(3),
    );
    assert!(again.is_err());

    let (halted, next) = halted_into_next(&store, &job).await;
    assert_eq!(halted.state(), JobState::Halted);
    assert_eq!(halted.exit_code, Some(HALT_EXIT_CODE));
    assert_eq!(halted.next_job, Some(next));
    assert_eq!(halted.lifecycle.history().len(), 4);
    assert_eq!(halted.lifecycle.last().reason, JobReason::HaltedCleanly);
    let requeued = store.job(next).await.unwrap().unwrap();
    assert_eq!(requeued.previous_job, Some(job.id));
    assert_eq!(requeued.chain.restart_count, 1);
    assert_eq!(requeued.chain.initial_job, job.id);
    assert_eq!(requeued.pinned_node, Some(node.clone()));
    assert_eq!(
        requeued.max_duration,
        Some(ongrid_core::HumanDuration::from_secs(7200 - 600))
    );
    assert_eq!(store.jobs(JobFilter::Owner(dn)).await.unwrap().len(), 2);

    store.record_job_log(job.id, 42, true).await.unwrap();
    let logged = store.job(job.id).await.unwrap().unwrap();
    assert_eq!((logged.log_size, logged.log_complete), (42, true));
    assert!(store.jobs(JobFilter::Node(node)).await.unwrap().is_empty());
}

/// The jobs QUEUED or holding GPUs (kept for planning by each store, see
/// `store::sql::planning`) follow every change of a job, made through the same store or
/// through another on the same database (a second replica): a job submitted, started, halted
/// into the next job of its chain, and removed (its chain's next job loses its link).
async fn the_active_jobs_follow_every_change_of_a_job(backend: Backend) {
    use crate::domain::jobs;
    use ongrid_core::job::JobState;

    let (place, a) = Place::opened(backend).await;
    let b = place.open().await;
    let node = NodeName::parse("node1").unwrap();
    register(&a, "node1", &[gpu(1)], t(0)).await;
    // Each shape of a job compared, as the kept copy holds it and as read alone.
    let shape = |job: &crate::domain::jobs::JobRecord| {
        (
            job.id,
            job.state(),
            job.node.clone(),
            job.gpus.clone(),
            job.previous_job,
            job.next_job,
        )
    };
    let active = |store: &TestStore| {
        let store = store.clone();
        async move {
            let jobs = store.jobs(JobFilter::Active).await.unwrap();
            let mut fresh = Vec::new();
            for job in &jobs {
                fresh.push(store.job(job.id).await.unwrap().unwrap());
            }
            assert_eq!(
                jobs.iter().map(shape).collect::<Vec<_>>(),
                fresh.iter().map(shape).collect::<Vec<_>>(),
                "the kept jobs are as stored"
            );
            jobs.iter().map(|j| (j.id, j.state())).collect::<Vec<_>>()
        }
    };
    // An ended job's output all in, then the job removed through `store`.
    let remove = |store: &TestStore, id: JobId, at: DateTime<Utc>| {
        let store = store.clone();
        async move {
            store.record_job_log(id, 0, true).await.unwrap();
            let removal = store
                .remove_job(id, std::time::Duration::ZERO, at)
                .await
                .unwrap();
            assert!(
                matches!(removal, crate::store::JobRemoval::Removed(_)),
                "{removal:?}"
            );
        }
    };

    let first = queued_job(&a, t(1), None).await;
    assert_eq!(active(&a).await, [(first.id, JobState::Queued)]);
    assert_eq!(active(&b).await, [(first.id, JobState::Queued)]);

    let second = queued_job(&b, t(2), None).await;
    let gpus = vec![GpuId::from(gpu(1).uuid)];
    let started = jobs::start(&first, node.clone(), gpus, t(2)).unwrap();
    let first = a.job_transition(first.id, started, None).await.unwrap();
    let both = [(first.id, JobState::Running), (second.id, JobState::Queued)];
    assert_eq!(active(&a).await, both);
    assert_eq!(active(&b).await, both);

    let (halted, next) = halted_into_next(&b, &first).await;
    assert_eq!(halted.state(), JobState::Halted);
    let after_halt = [(second.id, JobState::Queued), (next, JobState::Queued)];
    assert_eq!(active(&a).await, after_halt);
    assert_eq!(active(&b).await, after_halt);

    remove(&b, first.id, t(700)).await;
    // `active` compares the link as kept with the link as stored: gone from both.
    assert_eq!(active(&a).await, after_halt);
    let kept = a.jobs(JobFilter::Active).await.unwrap();
    assert_eq!(kept[1].previous_job, None);

    // A job cancelled and removed with no read of either copy between: a deleted row leaves no
    // stamp, and neither copy keeps it (`active` reads each kept job alone: a kept ghost fails).
    let third = queued_job(&a, t(800), None).await;
    assert_eq!(active(&a).await.len(), 3);
    assert_eq!(active(&b).await.len(), 3);
    let cancelled = jobs::cancel_by_owner(&third, t(801)).unwrap();
    a.job_transition(third.id, cancelled, None).await.unwrap();
    remove(&a, third.id, t(900)).await;
    assert_eq!(active(&a).await, after_halt);
    assert_eq!(active(&b).await, after_halt);
    // Read whole again once, the copies follow changes as before.
    let fourth = queued_job(&b, t(1000), None).await;
    assert_eq!(active(&a).await.len(), 3);
    assert_eq!(
        active(&b).await.last(),
        Some(&(fourth.id, JobState::Queued))
    );
    // Queued before the fourth though kept after it: in queue order in both copies.
    let fifth = queued_job(&a, t(950), None).await;
    let queue = [
        (second.id, JobState::Queued),
        (next, JobState::Queued),
        (fifth.id, JobState::Queued),
        (fourth.id, JobState::Queued),
    ];
    assert_eq!(active(&a).await, queue);
    assert_eq!(active(&b).await, queue);
}

/// The job changes of callers that wait for the write at the same time (two nodes' syncs) go in
/// one write, one change number for all, each caller's after the one's before it (a job the
/// first caller starts, the second asks to halt), and each caller gets the outcomes of its own
/// changes, a refused one among them; a caller alone gets a write of its own.
async fn job_changes_of_callers_waiting_together_share_one_write(backend: Backend) {
    use crate::domain::jobs;
    use ongrid_core::job::JobState;

    let (_place, store) = Place::opened(backend).await;
    let (node, [a, b, c]) = three_queued_jobs(&store).await;
    let on = |n: u8| vec![GpuId::from(gpu(n).uuid)];
    let first = vec![(
        a.id,
        jobs::start(&a, node.clone(), on(1), t(2)).unwrap(),
        None,
    )];
    let second = vec![
        // QUEUED to FINISHED is not a transition of the lifecycle: refused, this caller's alone.
        (b.id, finished(t(2)), None),
        (
            c.id,
            jobs::start(&c, node.clone(), on(2), t(2)).unwrap(),
            None,
        ),
        // Allowed only once the first caller's change started the job.
        (a.id, halt_asked(t(3)), None),
    ];
    let changing = [first, second].map(|changes| {
        let store = store.clone();
        async move { store.job_transition_all(changes).await.unwrap() }
    });
    let answers = written_together(&store, Together::Changes, changing, async {}).await;
    assert_eq!(answers[0].len(), 1);
    assert!(answers[0][0].is_ok(), "{answers:?}");
    assert_eq!(answers[1].len(), 3);
    assert!(
        matches!(answers[1][0], Err(StoreError::InvalidJobTransition(_))),
        "{answers:?}"
    );
    assert!(answers[1][1..].iter().all(Result::is_ok), "{answers:?}");
    let stored = |id| {
        let store = store.clone();
        async move { store.job(id).await.unwrap().unwrap() }
    };
    let states = |job: crate::domain::jobs::JobRecord| -> Vec<JobState> {
        job.lifecycle.history().iter().map(|t| t.to).collect()
    };
    assert_eq!(
        states(stored(a.id).await),
        [JobState::Queued, JobState::Running, JobState::MustHalt]
    );
    assert_eq!(stored(b.id).await.state(), JobState::Queued);
    assert_eq!(stored(c.id).await.state(), JobState::Running);
    let stamp_of = |id: JobId| job_stamp(&store, id);
    assert_eq!(
        stamp_of(a.id).await,
        stamp_of(c.id).await,
        "both callers' changes in one write"
    );
    // Alone, a caller's write is its own.
    let halt = halt_asked(t(4));
    let outcomes = store
        .job_transition_all(vec![(c.id, halt, None)])
        .await
        .unwrap();
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
    assert_ne!(stamp_of(a.id).await, stamp_of(c.id).await);
    assert_eq!(stored(c.id).await.state(), JobState::MustHalt);
    counts_match_the_tables(&store).await;
}

/// The output records of callers that wait for the write at the same time (two nodes' syncs)
/// are written when its turn comes: each job as its last record says, a job recorded by both
/// callers as the second says; an empty list is answered at once, without waiting for a write.
async fn job_logs_of_callers_waiting_together_keep_the_later_record(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let (_node, [a, b, c]) = three_queued_jobs(&store).await;
    let log = |id, size, complete| OutputKept { id, size, complete };
    let first = vec![log(a.id, 100, false), log(b.id, 10, false)];
    let second = vec![
        log(a.id, 150, false),
        log(c.id, 5, true),
        log(a.id, 200, true),
    ];
    let recording = [first, second].map(|logs| {
        let store = store.clone();
        async move { store.record_job_logs(logs).await }
    });
    let answers = written_together(&store, Together::SyncRecords, recording, async {}).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let stored = |id| {
        let store = store.clone();
        async move {
            let job = store.job(id).await.unwrap().unwrap();
            (job.log_size, job.log_complete)
        }
    };
    assert_eq!(stored(a.id).await, (200, true));
    assert_eq!(stored(b.id).await, (10, false));
    assert_eq!(stored(c.id).await, (5, true));
    let held = store.hold(Together::SyncRecords).await;
    let nothing = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        store.record_job_logs(Vec::new()),
    );
    nothing
        .await
        .expect("an empty list waits for no write")
        .unwrap();
    assert_eq!(store.waiting(Together::SyncRecords), 0);
    drop(held);
    store.record_job_log(b.id, 20, true).await.unwrap();
    assert_eq!(stored(b.id).await, (20, true));
}

/// A heartbeat, activity samples and output records of syncs that wait at the same time wait
/// for one write, whatever their kind, and each is answered its own: the node's last sync, how
/// many samples were recorded, the output record stored.
async fn sync_records_of_every_kind_waiting_together_are_written_together(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let (node, job, session) = node_with_a_session_and_a_job(&store).await;
    let answers = sync_records_written_together(&store, &node, job, session).await;
    let seen_at_registration = Some(Heartbeat {
        last_seen: t(0),
        gpus_changed: false,
    });
    assert_eq!(
        answers,
        [
            SyncAnswer::Beat(Ok(seen_at_registration)),
            SyncAnswer::Samples(Ok(1)),
            SyncAnswer::Output(Ok(()))
        ]
    );
    assert_eq!(store.nodes().await.unwrap()[0].last_seen, t(40));
    let facts = store
        .lifecycle_facts(FactsScope::Session(session))
        .await
        .unwrap();
    assert_eq!(facts[0].cpu.active_at, Some(t(41)));
    let job = store.job(job).await.unwrap().unwrap();
    assert_eq!((job.log_size, job.log_complete), (100, true));
}

/// When one kind of the records waiting together cannot be written (a session's stored reading
/// is damaged), the write of all fails and each is written again alone: the others are stored
/// and answered as such, and only the records that cannot be written get the error.
async fn a_sync_record_that_cannot_be_written_fails_alone(backend: Backend) {
    let (_place, store) = Place::opened(backend).await;
    let (node, job, session) = node_with_a_session_and_a_job(&store).await;
    let id = session.to_string();
    store
        .rows(
            "INSERT INTO session_lifecycle (session_id) VALUES (?) \
             ON CONFLICT (session_id) DO NOTHING",
            &[&id],
        )
        .await;
    store
        .rows(
            "UPDATE session_lifecycle SET cpu_sampled_at = 'damaged' WHERE session_id = ?",
            &[&id],
        )
        .await;
    let answers = sync_records_written_together(&store, &node, job, session).await;
    let [beat, SyncAnswer::Samples(Err(error)), output] = &answers[..] else {
        panic!("the samples are refused: {answers:?}")
    };
    assert!(error.contains("damaged"), "{error}");
    assert!(matches!(beat, SyncAnswer::Beat(Ok(Some(_)))), "{beat:?}");
    assert_eq!(*output, SyncAnswer::Output(Ok(())));
    assert_eq!(store.nodes().await.unwrap()[0].last_seen, t(40));
    let job = store.job(job).await.unwrap().unwrap();
    assert_eq!((job.log_size, job.log_complete), (100, true));
}

/// Node1 with two GPUs, a QUEUED job and Alice's session placed on the first GPU.
async fn node_with_a_session_and_a_job(store: &TestStore) -> (NodeName, JobId, SessionId) {
    let (node, [job, ..]) = three_queued_jobs(store).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let session = create(store, &alice.dn, Some("a"), t(0)).await;
    let placement = Placement::Place {
        node: node.clone(),
        gpus: vec![GpuId::Gpu(gpu(1).uuid)],
    };
    let change = change(SessionState::Starting, t(1), "placed", placement);
    let session = moved(store, session.id, change).await.id;
    (node, job.id, session)
}

/// What a record of a sync was answered, its error as text.
#[derive(Debug, PartialEq)]
enum SyncAnswer {
    Beat(Result<Option<Heartbeat>, String>),
    Samples(Result<usize, String>),
    Output(Result<(), String>),
}

/// [`sync_records`], held at the queue until all three wait there, then written: their answers.
async fn sync_records_written_together(
    store: &TestStore,
    node: &NodeName,
    job: JobId,
    session: SessionId,
) -> Vec<SyncAnswer> {
    let records = sync_records(store, node, job, session);
    written_together(store, Together::SyncRecords, records, async {}).await
}

/// A sync's records of each kind on `node`: its heartbeat at t(40), a busy sample of `session`
/// at t(41), 100 bytes of `job`'s output, all of it.
fn sync_records(
    store: &TestStore,
    node: &NodeName,
    job: JobId,
    session: SessionId,
) -> [futures::future::BoxFuture<'static, SyncAnswer>; 3] {
    use crate::domain::sessions::holds::LifecycleConfig;
    use futures::FutureExt;
    use ongrid_core::holds::ContainerActivity;

    let text = |error: StoreError| error.to_string();
    let beat = {
        let (store, node) = (store.clone(), node.clone());
        async move {
            let seen = store.record_sync(&node, &[gpu(1), gpu(2)], t(40)).await;
            SyncAnswer::Beat(seen.map_err(text))
        }
        .boxed()
    };
    let samples = {
        let (store, node) = (store.clone(), node.clone());
        let sample = ContainerActivity {
            session_id: session,
            sampled_at: t(41),
            cpu_percent: 90.0,
            gpu_percent: None,
        };
        async move {
            let lifecycle = LifecycleConfig::default();
            let recorded = store
                .record_activity(&node, &[sample], t(41), &lifecycle)
                .await;
            SyncAnswer::Samples(recorded.map_err(text))
        }
        .boxed()
    };
    let output = {
        let store = store.clone();
        let kept = OutputKept {
            id: job,
            size: 100,
            complete: true,
        };
        async move { SyncAnswer::Output(store.record_job_logs(vec![kept]).await.map_err(text)) }
            .boxed()
    };
    [beat, samples, output]
}

/// Job changes stored in one write: each one its job's lifecycle allows is stored, with its
/// placement and exit code; a refused one and one of an unknown job are answered as refused, and
/// nothing of them is written; a job changed twice is changed the second time as the first left
/// it.
async fn job_changes_stored_together_skip_the_refused_ones(backend: Backend) {
    use crate::domain::jobs;
    use ongrid_core::job::{JobReason, JobState};

    let (_place, store) = Place::opened(backend).await;
    let (node, [a, b, c]) = three_queued_jobs(&store).await;
    let on = |n: u8| vec![GpuId::from(gpu(n).uuid)];
    let unknown = JobId::new_random();
    let outcomes = store
        .job_transition_all(vec![
            (
                a.id,
                jobs::start(&a, node.clone(), on(1), t(2)).unwrap(),
                None,
            ),
            (unknown, jobs::cancel_by_owner(&a, t(2)).unwrap(), None),
            // QUEUED to FINISHED is not a transition of the lifecycle: its exit code stays out.
            (b.id, finished(t(2)), None),
            (
                c.id,
                jobs::start(&c, node.clone(), on(2), t(2)).unwrap(),
                None,
            ),
            // A job changed a second time in the same write: after its first change, which
            // placed it.
            (a.id, halt_asked(t(3)), None),
            (
                a.id,
                job_change(
                    JobState::Failed,
                    t(4),
                    JobReason::Exited { code: 3 },
                    Some(3),
                ),
                None,
            ),
        ])
        .await
        .unwrap();
    assert_eq!(outcomes.len(), 6);
    assert!(outcomes[0].is_ok(), "{outcomes:?}");
    assert!(matches!(outcomes[1], Err(StoreError::NoSuchJob(id)) if id == unknown));
    assert!(
        matches!(outcomes[2], Err(StoreError::InvalidJobTransition(_))),
        "{outcomes:?}"
    );
    assert!(outcomes[3..].iter().all(Result::is_ok), "{outcomes:?}");

    use JobState::{Failed, MustHalt, Queued, Running};
    let stored = |id| {
        let store = store.clone();
        async move { store.job(id).await.unwrap().unwrap() }
    };
    let a = stored(a.id).await;
    let states: Vec<JobState> = a.lifecycle.history().iter().map(|t| t.to).collect();
    assert_eq!(states, [Queued, Running, MustHalt, Failed]);
    assert_eq!(a.lifecycle.last().at, t(4));
    assert_eq!(
        (&a.node, &a.gpus, a.exit_code),
        (&Some(node.clone()), &on(1), Some(3))
    );
    let b = stored(b.id).await;
    assert_eq!(b.lifecycle.history().len(), 1);
    assert_eq!((b.state(), b.exit_code, &b.node), (Queued, None, &None));
    let c = stored(c.id).await;
    assert_eq!(c.lifecycle.history().len(), 2);
    assert_eq!(
        (c.state(), &c.node, &c.gpus),
        (Running, &Some(node), &on(2))
    );
    assert_eq!(c.exit_code, None);
    assert!(store.job(unknown).await.unwrap().is_none());
    assert!(store
        .job_transition_all(Vec::new())
        .await
        .unwrap()
        .is_empty());
}

/// A job ended in a write with other changes creates the next job of its chain in that write,
/// linked both ways; a change of that next job later in the same write finds it. A refused
/// change creates no next job.
async fn a_job_change_stored_together_with_others_creates_the_next_job_of_its_chain(
    backend: Backend,
) {
    use crate::domain::jobs::{self, JobLimits};
    use ongrid_core::job::{JobReason, JobState, HALT_EXIT_CODE};

    let (_place, store) = Place::opened(backend).await;
    let node = NodeName::parse("node1").unwrap();
    register(&store, "node1", &[gpu(1)], t(0)).await;
    let first = queued_job(&store, t(1), None).await;
    let other = queued_job(&store, t(1), None).await;
    let started = jobs::start(&first, node.clone(), vec![GpuId::from(gpu(1).uuid)], t(2));
    let first = store
        .job_transition(first.id, started.unwrap(), None)
        .await
        .unwrap();
    let halted = job_change(
        JobState::Halted,
        t(602),
        JobReason::HaltedCleanly,
        Some(HALT_EXIT_CODE),
    );
    let limits = JobLimits::default();
    let next = jobs::next_in_chain(&first, &halted, JobId::new_random(), &limits).unwrap();
    // `other` is QUEUED: it cannot be HALTED, and the job that would follow it is not created.
    let refused_next = jobs::next_in_chain(&other, &halted, JobId::new_random(), &limits).unwrap();
    let cancel_next = job_change(
        JobState::Cancelled,
        t(603),
        JobReason::CancelledByUser,
        None,
    );
    let outcomes = store
        .job_transition_all(vec![
            (other.id, halted.clone(), Some(refused_next.clone())),
            (first.id, halted, Some(next.clone())),
            (next.id, cancel_next, None),
        ])
        .await
        .unwrap();
    assert!(
        matches!(outcomes[0], Err(StoreError::InvalidJobTransition(_))),
        "{outcomes:?}"
    );
    assert!(outcomes[1..].iter().all(Result::is_ok), "{outcomes:?}");

    let first = store.job(first.id).await.unwrap().unwrap();
    assert_eq!(first.state(), JobState::Halted);
    assert_eq!(first.exit_code, Some(HALT_EXIT_CODE));
    assert_eq!(first.next_job, Some(next.id));
    let stored_next = store.job(next.id).await.unwrap().unwrap();
    assert_eq!(stored_next.previous_job, Some(first.id));
    assert_eq!(stored_next.chain.initial_job, first.id);
    assert_eq!(stored_next.chain.restart_count, 1);
    assert_eq!(stored_next.pinned_node, Some(node));
    let states: Vec<JobState> = stored_next
        .lifecycle
        .history()
        .iter()
        .map(|t| t.to)
        .collect();
    assert_eq!(states, [JobState::Queued, JobState::Cancelled]);
    assert_eq!(
        stored_next.lifecycle.history()[0].reason,
        JobReason::Requeued {
            previous: first.id,
            restart_count: 1
        }
    );
    let other = store.job(other.id).await.unwrap().unwrap();
    assert_eq!((other.state(), other.next_job), (JobState::Queued, None));
    assert!(store.job(refused_next.id).await.unwrap().is_none());
    counts_match_the_tables(&store).await;
}

/// A job's change to FINISHED with exit code 0 at `at` (refused for a QUEUED job).
fn finished(at: DateTime<Utc>) -> crate::domain::jobs::JobChange {
    use ongrid_core::job::{JobReason, JobState};
    job_change(
        JobState::Finished,
        at,
        JobReason::Exited { code: 0 },
        Some(0),
    )
}

/// A job's owner asking it to halt at `at`.
fn halt_asked(at: DateTime<Utc>) -> crate::domain::jobs::JobChange {
    use ongrid_core::job::{JobReason, JobState};
    job_change(JobState::MustHalt, at, JobReason::HaltedByUser, None)
}

/// A change of a job to `to` at `at`, with no placement.
fn job_change(
    to: ongrid_core::job::JobState,
    at: DateTime<Utc>,
    reason: ongrid_core::job::JobReason,
    exit_code: Option<i32>,
) -> crate::domain::jobs::JobChange {
    crate::domain::jobs::JobChange {
        to,
        at,
        reason,
        place: None,
        exit_code,
    }
}

/// Submits that arrive together are written in one write: each answered with the job as a read
/// gives it back, one of an owner removed refused, a second submit of the same job refused
/// alone without failing the others.
async fn submits_written_together_each_keep_their_own_answer(backend: Backend) {
    use crate::domain::grid_jobs::GridJob;
    let (_place, store) = Place::opened(backend).await;
    let [alice, bob, carol] = bob_removed(&store).await;
    let spec = || ongrid_core::job::JobSpecFile {
        restartable: true,
        max_duration: Some("2h".into()),
        ..Default::default()
    };
    let account = crate::domain::grid_jobs::LocalAccount::parse("alice").unwrap();
    let grid = GridJob::submitting(ongrid_core::job::JobTarget::Htcondor, account, t(12));
    let first = fixtures::job(&alice, spec(), None, t(10));
    let together = [
        first.clone(),
        fixtures::job(&bob, spec(), None, t(11)),
        fixtures::job(&alice, spec(), Some(grid), t(12)),
        fixtures::job(&carol, spec(), None, t(13)),
    ];
    let answers = submit_together(&store, &together).await;
    let stamp_of = |id: JobId| job_stamp(&store, id);
    let mut stamps = BTreeSet::new();
    for (i, answer) in answers.iter().enumerate() {
        match (i, answer) {
            (1, Err(StoreError::UserRemoved(who))) => assert_eq!(*who, bob.dn),
            (0 | 2 | 3, Ok(job)) => {
                assert_eq!(job.id, together[i].id);
                let read = store.job(job.id).await.unwrap().expect("stored");
                assert_eq!(*job, read, "answered as stored");
                stamps.insert(stamp_of(job.id).await);
            }
            other => panic!("submit {i}: {other:?}"),
        }
    }
    assert_eq!(stamps.len(), 1, "one write: {stamps:?}");
    assert!(store.job(together[1].id).await.unwrap().is_none());

    // The same job again beside another: the write of both fails, each is written alone.
    let again = [first, fixtures::job(&carol, spec(), None, t(20))];
    let answers = submit_together(&store, &again).await;
    assert!(
        matches!(answers[0], Err(StoreError::Database(_))),
        "{:?}",
        answers[0]
    );
    let job = answers[1].as_ref().expect("the other stored");
    assert_eq!(*job, store.job(job.id).await.unwrap().unwrap());
    assert!(!stamps.contains(&stamp_of(job.id).await));
}

/// Alice, Bob and Carol, Bob removed by Alice at t(1) (with nothing of his).
async fn bob_removed(store: &TestStore) -> [UserRecord; 3] {
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let bob = store.user(&dn("Bob"), 20_000).await.unwrap();
    let carol = store.user(&dn("Carol"), 20_000).await.unwrap();
    let none = crate::domain::users::Removal {
        sessions: Vec::new(),
        jobs: Vec::new(),
        images: Vec::new(),
    };
    store
        .remove_user(&bob.dn, &alice.dn, t(1), &none)
        .await
        .unwrap()
        .expect("Bob removed");
    [alice, bob, carol]
}

/// Submits `jobs` together: each waits while the turn of the submits is held, until all do.
async fn submit_together(
    store: &TestStore,
    jobs: &[crate::domain::jobs::NewJob],
) -> Vec<StoreResult<crate::domain::jobs::JobRecord>> {
    let submitting = jobs.iter().cloned().map(|new| {
        let store = store.clone();
        async move { store.create_job(new).await }
    });
    written_together(store, Together::Submits, submitting, async {}).await
}

/// Sends `requests` while the writes of `kind` are held, each once the one before waits (so they
/// are written in that order), runs `meanwhile` once all of them wait, then lets them be written
/// together: their answers, in order.
async fn written_together<T, R>(
    store: &TestStore,
    kind: Together,
    requests: impl IntoIterator<Item = R>,
    meanwhile: impl std::future::Future<Output = ()>,
) -> Vec<T>
where
    R: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let held = store.hold(kind).await;
    let mut sent = Vec::new();
    for request in requests {
        sent.push(tokio::spawn(request));
        let joined = async {
            while store.waiting(kind) < sent.len() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), joined)
            .await
            .expect("each request waits for the write held");
    }
    meanwhile.await;
    drop(held);
    futures::future::join_all(sent)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// Node1 with two GPUs, and three of Alice's jobs QUEUED at t(1).
async fn three_queued_jobs(store: &TestStore) -> (NodeName, [crate::domain::jobs::JobRecord; 3]) {
    register(store, "node1", &[gpu(1), gpu(2)], t(0)).await;
    let jobs = [
        queued_job(store, t(1), None).await,
        queued_job(store, t(1), None).await,
        queued_job(store, t(1), None).await,
    ];
    (NodeName::parse("node1").unwrap(), jobs)
}

/// The change number job `id`'s row carries.
async fn job_stamp(store: &TestStore, id: JobId) -> String {
    change_number(store, "jobs", id.to_string()).await
}

/// The change number the row `id` of `table` (`sessions` or `jobs`) carries.
async fn change_number(store: &TestStore, table: &str, id: String) -> String {
    let sql = format!("SELECT CAST(change_seq AS TEXT) FROM {table} WHERE id = ?");
    let rows = store.rows(&sql, &[&id]).await;
    rows[0][0].clone().expect("a change number")
}

/// Alice's QUEUED job submitted at `at` (restartable, on the local target unless `grid`).
async fn queued_job(
    store: &TestStore,
    at: DateTime<Utc>,
    grid: Option<crate::domain::grid_jobs::GridJob>,
) -> crate::domain::jobs::JobRecord {
    let alice = store
        .user(&Dn::parse("/CN=Alice").unwrap(), 20_000)
        .await
        .unwrap();
    let spec = ongrid_core::job::JobSpecFile {
        restartable: true,
        max_duration: Some("2h".into()),
        ..Default::default()
    };
    let new = fixtures::job(&alice, spec, grid, at);
    store.create_job(new).await.unwrap()
}

/// A node's jobs take the lifecycle of those the kept copy holds as stored from the copy: each
/// is as read alone, whether the copy saw its last change, saw none of it (another replica
/// wrote it) or does not hold it (ended, its output still to come); the output's size, which
/// changes unstamped, is as written.
async fn a_nodes_jobs_are_as_stored_whatever_the_kept_copy_has_seen(backend: Backend) {
    use crate::domain::jobs;
    use ongrid_core::job::{JobState, ObservedJobStatus};

    let (place, a) = Place::opened(backend).await;
    let b = place.open().await;
    let node = NodeName::parse("node1").unwrap();
    register(&a, "node1", &[gpu(1), gpu(2)], t(0)).await;
    // The node's jobs through `store`, each required equal to itself read alone.
    let on_node = |store: &TestStore| {
        let (store, node) = (store.clone(), node.clone());
        async move {
            let jobs = store.jobs(JobFilter::Node(node)).await.unwrap();
            for job in &jobs {
                assert_eq!(Some(job), store.job(job.id).await.unwrap().as_ref());
            }
            jobs.iter().map(|j| (j.id, j.state())).collect::<Vec<_>>()
        }
    };
    let run = |store: &TestStore, job: jobs::JobRecord, gpu: u8| {
        let (store, node) = (store.clone(), node.clone());
        async move {
            let gpus = vec![GpuId::from(super::fixtures::gpu(gpu).uuid)];
            let started = jobs::start(&job, node, gpus, t(2)).unwrap();
            store.job_transition(job.id, started, None).await.unwrap()
        }
    };

    // No copy kept yet: each read with its history.
    let first = queued_job(&a, t(1), None).await;
    let second = queued_job(&a, t(1), None).await;
    let first = run(&a, first, 1).await;
    let second = run(&a, second, 2).await;
    let mut running = vec![
        (first.id, JobState::Running),
        (second.id, JobState::Running),
    ];
    running.sort();
    let sorted = |mut jobs: Vec<(JobId, JobState)>| {
        jobs.sort();
        jobs
    };
    assert_eq!(sorted(on_node(&a).await), running);
    assert_eq!(a.kept_jobs_found(), (0, 0), "no copy kept yet");
    // Both kept by `a` as stored now, and taken from its copy; the output's size written since
    // is not stamped, and read.
    assert_eq!(a.jobs(JobFilter::Active).await.unwrap().len(), 2);
    a.record_job_log(first.id, 4096, false).await.unwrap();
    assert_eq!(sorted(on_node(&a).await), running);
    let read = a.jobs(JobFilter::Node(node.clone())).await.unwrap();
    assert!(read
        .iter()
        .any(|job| job.id == first.id && job.log_size == 4096));
    assert_eq!(
        a.kept_jobs_found(),
        (4, 0),
        "both jobs from the copy, twice"
    );

    // Halted through `b`, which `a`'s copy has not seen: read with its history.
    let halt = jobs::halt_by_owner(&first, t(600)).unwrap();
    let first = b.job_transition(first.id, halt, None).await.unwrap();
    let halting = sorted(vec![
        (first.id, first.state()),
        (second.id, JobState::Running),
    ]);
    assert_ne!(first.state(), JobState::Running);
    assert_eq!(sorted(on_node(&a).await), halting);
    assert_eq!(
        a.kept_jobs_found(),
        (5, 0),
        "the halted one read with its history"
    );
    // `a`'s copy brought up to date: both from it again, the halted one as its change left it.
    assert_eq!(a.jobs(JobFilter::Active).await.unwrap().len(), 2);
    assert_eq!(sorted(on_node(&a).await), halting);
    assert_eq!(a.kept_jobs_found(), (7, 0));

    // Ended with output still to come: the copy lets go of it, the node keeps it.
    let exited = ObservedJobStatus::Exited {
        started_at: t(2),
        finished_at: t(602),
        exit_code: 1,
        oom_killed: false,
        killed: false,
        signalled_at: None,
    };
    let change = jobs::follow_report(&first, &exited, t(603)).unwrap();
    let first = b.job_transition(first.id, change, None).await.unwrap();
    assert!(!first.state().holds_gpus() && first.state() != JobState::Queued);
    let ended = sorted(vec![
        (first.id, first.state()),
        (second.id, JobState::Running),
    ]);
    assert_eq!(sorted(on_node(&a).await), ended);
    assert_eq!(a.jobs(JobFilter::Active).await.unwrap().len(), 1);
    assert_eq!(sorted(on_node(&a).await), ended);
    assert_eq!(sorted(on_node(&b).await), ended);
    // The ended one read with its history each time, the running one from the copy.
    assert_eq!(a.kept_jobs_found(), (9, 0));
    assert_eq!(b.kept_jobs_found(), (0, 0), "`b` kept no copy");
}

/// `job`, RUNNING since t(2), halted by its owner at t(600) and exited cleanly at t(602): stored
/// HALTED at t(603) with the next job of its chain, whose id comes with it.
async fn halted_into_next(
    store: &TestStore,
    job: &crate::domain::jobs::JobRecord,
) -> (crate::domain::jobs::JobRecord, JobId) {
    use crate::domain::jobs::{self, JobLimits};
    use ongrid_core::job::{ObservedJobStatus, HALT_EXIT_CODE};

    let halt = jobs::halt_by_owner(job, t(600)).unwrap();
    let job = store.job_transition(job.id, halt, None).await.unwrap();
    let exited = ObservedJobStatus::Exited {
        started_at: t(2),
        finished_at: t(602),
        exit_code: HALT_EXIT_CODE,
        oom_killed: false,
        killed: false,
        signalled_at: None,
    };
    let change = jobs::follow_report(&job, &exited, t(603)).unwrap();
    let next =
        jobs::next_in_chain(&job, &change, JobId::new_random(), &JobLimits::default()).unwrap();
    let halted = store
        .job_transition(job.id, change, Some(next.clone()))
        .await
        .unwrap();
    (halted, next.id)
}

/// `devctl job rm` and the retention's prune: a job goes only once it ended, its output is in
/// and no grid engine follows it; with it go its history, its grid row, the links to it from
/// its chain and, with the chain's last job, the chain's reservation. The rest stays.
async fn ended_jobs_are_removed_with_what_refers_to_them_and_never_sooner(backend: Backend) {
    use crate::domain::engine_job::EnginePoll;
    use crate::domain::grid_jobs::{GridJob, LocalAccount};
    use crate::domain::jobs;
    use crate::domain::policy::reservations::ReservationName;
    use crate::domain::Refusal;
    use ongrid_core::job::JobTarget;
    use std::time::Duration;

    let (_place, store) = Place::opened(backend).await;
    let grace = Duration::from_secs(600);
    let node = NodeName::parse("node1").unwrap();
    register(&store, "node1", &[gpu(1)], t(0)).await;
    // A restart chain: `first` ran and halted at t(602), `second` follows it, QUEUED.
    let first = queued_job(&store, t(1), None).await;
    let reservation = ReservationName::parse("course").unwrap();
    store
        .gpu_policy()
        .set_chain_reservation(first.id, &reservation)
        .await
        .unwrap();
    let gpus = vec![GpuId::from(gpu(1).uuid)];
    let started = jobs::start(&first, node.clone(), gpus, t(2)).unwrap();
    let first = store.job_transition(first.id, started, None).await.unwrap();
    let (first, next) = halted_into_next(&store, &first).await;
    let second = store.job(next).await.unwrap().unwrap();
    // A grid job cancelled here at t(800), which HTCondor has not confirmed yet.
    let account = LocalAccount::parse("alice").unwrap();
    let grid = queued_job(
        &store,
        t(700),
        Some(GridJob::submitting(JobTarget::Htcondor, account, t(700))),
    )
    .await;
    let cancel = jobs::cancel_by_owner(&grid, t(800)).unwrap();
    let grid = store.job_transition(grid.id, cancel, None).await.unwrap();
    store.record_job_log(grid.id, 0, true).await.unwrap();

    let count = |table: &'static str, column: &'static str, id: JobId| {
        let store = store.clone();
        async move {
            let sql = format!("SELECT CAST(COUNT(*) AS TEXT) FROM {table} WHERE {column} = ?");
            store.rows(&sql, &[&id.to_string()]).await[0][0]
                .clone()
                .unwrap()
        }
    };

    // Not ended, output still coming in, no engine confirmation: refused, and nothing pruned.
    let refused = |removal: JobRemoval| match removal {
        JobRemoval::Refused(Refusal::Conflict(message)) => message,
        other => panic!("{other:?}"),
    };
    let message = refused(store.remove_job(second.id, grace, t(610)).await.unwrap());
    assert!(
        message.contains("is QUEUED and has not ended: cancel it first"),
        "{message}"
    );
    let message = refused(store.remove_job(first.id, grace, t(610)).await.unwrap());
    assert!(message.contains("still coming in from node1"), "{message}");
    let message = refused(store.remove_job(grid.id, grace, t(5000)).await.unwrap());
    assert!(
        message.contains("htcondor has not yet confirmed"),
        "{message}"
    );
    assert_eq!(
        store
            .remove_job(JobId::new_random(), grace, t(610))
            .await
            .unwrap(),
        JobRemoval::NoSuchJob
    );
    // It ended when its process exited, at t(602).
    assert_eq!(store.prune_jobs(t(602), 10).await.unwrap(), vec![]);

    // Past its end: the first job goes, the second keeps its record and the chain's reservation
    // (its chain is not over), without the link to the first.
    assert_eq!(store.prune_jobs(t(603), 10).await.unwrap(), vec![first.id]);
    assert_eq!(store.job(first.id).await.unwrap(), None);
    assert_eq!(count("job_transitions", "job_id", first.id).await, "0");
    let second = store.job(second.id).await.unwrap().unwrap();
    assert_eq!(second.previous_job, None);
    assert_eq!(second.chain.initial_job, first.id);
    assert_eq!(
        count("job_chain_reservations", "chain_initial", first.id).await,
        "1"
    );
    // The grid job waits for its engine however old it is.
    assert_eq!(store.prune_jobs(t(100_000), 10).await.unwrap(), vec![]);

    // The second job cancelled before it ran (no output to wait for): removed by its owner,
    // with the chain's reservation.
    let cancel = jobs::cancel_by_owner(&second, t(900)).unwrap();
    store.job_transition(second.id, cancel, None).await.unwrap();
    let JobRemoval::Removed(removed) = store.remove_job(second.id, grace, t(901)).await.unwrap()
    else {
        panic!("not removed")
    };
    assert_eq!(
        (removed.id, removed.state()),
        (second.id, ongrid_core::job::JobState::Cancelled)
    );
    assert_eq!(store.job(second.id).await.unwrap(), None);
    assert_eq!(
        count("job_chain_reservations", "chain_initial", first.id).await,
        "0"
    );

    // Once HTCondor confirmed the end, the grid job goes with its grid row; in batches.
    let third = queued_job(&store, t(1000), None).await;
    let cancel = jobs::cancel_by_owner(&third, t(1001)).unwrap();
    store.job_transition(third.id, cancel, None).await.unwrap();
    store
        .record_engine_poll(grid.id, EnginePoll::done("removed", t(1100)))
        .await
        .unwrap();
    let batch = store.prune_jobs(t(100_000), 1).await.unwrap();
    assert_eq!(batch, vec![grid.id], "oldest first");
    assert_eq!(count("grid_jobs", "job_id", grid.id).await, "0");
    assert_eq!(
        store.prune_jobs(t(100_000), 1).await.unwrap(),
        vec![third.id]
    );
    assert_eq!(store.prune_jobs(t(100_000), 1).await.unwrap(), vec![]);
    let dn = Dn::parse("/CN=Alice").unwrap();
    assert!(store.jobs(JobFilter::Owner(dn)).await.unwrap().is_empty());
    counts_match_the_tables(&store).await;
}

/// The retention's prune of the audit log: connections closed before the cutoff go, in
/// batches; open ones stay however old.
async fn closed_connections_are_pruned_and_open_ones_kept(backend: Backend) {
    use ongrid_core::api::ConnectionEventKind::{Close, Open};

    let (_place, store) = Place::opened(backend).await;
    let alice = dn("Alice");
    store.user(&alice, 20_000).await.unwrap();
    let session = running_session(&store, &alice, "train1").await;
    for (n, open, close) in [
        (1, 10, Some(20)),
        (2, 11, None),
        (3, 12, Some(30)),
        (4, 13, Some(40)),
    ] {
        connection_event(&store, &session, n, Open, t(open), (0, 0)).await;
        if let Some(close) = close {
            connection_event(&store, &session, n, Close, t(close), (1, 1)).await;
        }
    }
    let kept = |store: TestStore| async move {
        let filter = AuditFilter {
            owner: None,
            since: None,
            limit: 100,
        };
        let mut ids: Vec<u128> = store
            .audit(filter)
            .await
            .unwrap()
            .iter()
            .map(|r| r.connection_id.as_u128())
            .collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(store.prune_connections(t(20), 10).await.unwrap(), 0);
    assert_eq!(store.prune_connections(t(21), 10).await.unwrap(), 1);
    assert_eq!(kept(store.clone()).await, vec![2, 3, 4]);
    assert_eq!(store.prune_connections(t(1000), 1).await.unwrap(), 1);
    assert_eq!(kept(store.clone()).await, vec![2, 4]);
    assert_eq!(store.prune_connections(t(1000), 10).await.unwrap(), 1);
    assert_eq!(store.prune_connections(t(1000), 10).await.unwrap(), 0);
    assert_eq!(kept(store.clone()).await, vec![2]);
    // The open one still counts for its session.
    let closed = connection_event(&store, &session, 2, Close, t(2000), (1, 1)).await;
    assert_eq!(closed.open_connections, 0);
}

/// `copy-store`: a SQLite store with a restart chain (jobs referring to each other both ways),
/// booleans and sessions copied into an empty PostgreSQL database reads back the same there, as
/// the same store one generation on; a second copy into the same database is refused and
/// changes nothing.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_sqlite_store_copies_into_an_empty_postgres_database() {
    use crate::domain::jobs;
    use crate::store::copy::{sqlite_to_postgres, CopyError};

    let (place, store) = Place::opened(Backend::Sqlite).await;
    let dn = Dn::parse("/CN=Alice").unwrap();
    let node = NodeName::parse("node1").unwrap();
    register(&store, "node1", &[gpu(1)], t(0)).await;
    let job = queued_job(&store, t(1), None).await;
    let gpus = vec![GpuId::from(gpu(1).uuid)];
    let started = jobs::start(&job, node, gpus, t(2)).unwrap();
    let job = store.job_transition(job.id, started, None).await.unwrap();
    let (_, next) = halted_into_next(&store, &job).await;
    store.record_job_log(job.id, 42, true).await.unwrap();
    let session = create(&store, &dn, Some("copied"), t(3)).await;
    let jobs_before = store.jobs(JobFilter::Owner(dn.clone())).await.unwrap();
    let sessions_before = store.sessions(SessionFilter::All).await.unwrap();
    let identity = store.identity().await.unwrap();
    let counts_before = store.state_counts().await.unwrap();
    store.close().await;

    let Database::Sqlite(file) = &place.database else {
        panic!("{:?}", place.database)
    };
    let url = super::test_server::fresh_database().await;
    let copied = sqlite_to_postgres(file, &url).await.unwrap();
    assert_eq!(copied.tables.get("jobs"), Some(&2));
    assert_eq!(copied.tables.get("sessions"), Some(&1));

    let target = Database::Postgres(url.clone()).open().await.unwrap();
    let target = TestStore(target);
    assert_eq!(
        target.jobs(JobFilter::Owner(dn.clone())).await.unwrap(),
        jobs_before
    );
    let first = target.job(job.id).await.unwrap().unwrap();
    assert_eq!(first.next_job, Some(next));
    assert_eq!((first.log_size, first.log_complete), (42, true));
    assert_eq!(
        target.job(next).await.unwrap().unwrap().previous_job,
        Some(job.id)
    );
    assert_eq!(
        target.sessions(SessionFilter::All).await.unwrap(),
        sessions_before
    );
    assert_eq!(
        target.transitions(session.id).await.unwrap().len(),
        1,
        "the history came along"
    );
    let copy = target.identity().await.unwrap();
    assert_eq!(
        (&copy.id, copy.generation),
        (&identity.id, identity.generation + 1),
        "the same store, one generation on"
    );
    // The counts by state are the target's triggers' own, made from the rows copied (the
    // source's are not copied), and count the target's writes after the copy.
    assert_eq!(target.state_counts().await.unwrap(), counts_before);
    create(&target, &dn, Some("after"), t(4)).await;
    let counts = target.state_counts().await.unwrap();
    assert_eq!(counts.sessions, [("PENDING".to_owned(), 2)]);
    assert_eq!(counts.jobs, counts_before.jobs);
    target.close().await;

    let again = sqlite_to_postgres(file, &url).await.unwrap_err();
    assert!(matches!(again, CopyError::NotEmpty(_)), "{again}");
}
