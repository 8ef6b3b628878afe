//! The scheduling round against a real store, time moved by a manual clock.

use chrono::{TimeDelta, TimeZone};
use ongrid_core::{Dn, GpuHealth, GpuId, GpuInfo, GpuRequest, NodeName};

use super::*;
use crate::clock::ManualClock;
use crate::domain::nodes;
use crate::domain::sessions::SessionRecord;
use crate::store::fixtures::{self, gpu};
use crate::store::SqliteStore;

const TIMEOUT: Duration = Duration::from_secs(30);

fn t0() -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000, 0).unwrap()
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<SqliteStore>,
    scheduler: Scheduler,
    owner: Dn,
}

async fn fixture(gpus: &[GpuInfo]) -> Fixture {
    let (dir, store) = fixtures::sqlite().await;
    let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
    store.user(&owner, 20_000).await.unwrap();
    let node1 = fixtures::registration("node1");
    store.register_node(node1, gpus, t0()).await.unwrap();
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
    let new = fixtures::new_session(&f.owner, at);
    f.store.create_session(new).await.unwrap()
}

async fn state(f: &Fixture, s: &SessionRecord) -> SessionRecord {
    f.store.session(s.id).await.unwrap().unwrap()
}

async fn stored_job(f: &Fixture, id: JobId) -> jobs::JobRecord {
    f.store.job(id).await.unwrap().unwrap()
}

/// A request that asked for a round (`Scheduler::cover`) can stop waiting while a round is under
/// way, its session still PENDING; the round it asked for runs once that one ended, places the
/// session, and says so to whoever still waits.
#[tokio::test]
async fn a_request_may_answer_before_the_round_it_asked_for_which_still_places_it() {
    let f = fixture(&[gpu(1)]).await;
    let session = create(&f, t0()).await;
    let Fixture {
        store, scheduler, ..
    } = f;
    let changes = Changes::new(CancellationToken::new());
    let scheduler = Arc::new(scheduler.with_changes(changes.clone()));
    let stored = || async { store.session(session.id).await.unwrap().unwrap() };
    let under_way = scheduler.tick_lock.lock().await;
    let asked = changes.ask_round();
    scheduler.cover(asked, session.id);
    let answered = tokio::time::timeout(Duration::from_millis(100), changes.covered(asked)).await;
    assert!(answered.is_err(), "covered while a round was under way");
    assert_eq!(stored().await.state, SessionState::Pending);
    drop(under_way);
    tokio::time::timeout(TIMEOUT, changes.covered(asked))
        .await
        .expect("the round asked for ran once the one under way ended");
    let placed = stored().await;
    assert_eq!(placed.state, SessionState::Starting, "{}", placed.reason);
}

/// Requests that each committed a session and want a round after it share rounds: ten at once
/// run two (the first starts before the others asked; the second covers them all), and every
/// session is placed by them.
#[tokio::test]
async fn requests_waiting_for_a_round_share_one() {
    let gpus: Vec<GpuInfo> = (1..=10).map(gpu).collect();
    let f = fixture(&gpus).await;
    let mut sessions = Vec::new();
    for i in 0..10 {
        sessions.push(create(&f, t0() + TimeDelta::seconds(i)).await);
    }
    let rounds = futures::future::join_all((0..10).map(|_| f.scheduler.tick_covering())).await;
    let ran: Vec<TickReport> = rounds.into_iter().filter_map(Result::unwrap).collect();
    assert_eq!(ran.len(), 2, "{ran:?}");
    assert_eq!(ran.iter().map(|r| r.placed).sum::<usize>(), 10);
    for session in &sessions {
        assert_eq!(state(&f, session).await.state, SessionState::Starting);
    }
    // Asked again after those rounds, a round runs: none has started since.
    assert_eq!(
        f.scheduler.tick_covering().await.unwrap(),
        Some(TickReport::default())
    );
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

    let removed = Change::keep_placement(SessionState::Ended, t0(), "removed");
    f.store.transition(first.id, removed).await.unwrap();
    assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
    assert_eq!(state(&f, &second).await.state, SessionState::Starting);
}

#[tokio::test]
async fn a_replica_that_does_not_lead_places_nothing_until_it_leads() {
    let mut f = fixture(&[gpu(1)]).await;
    let (lead, leader) = Leader::follower();
    f.scheduler = f.scheduler.with_leader(leader);
    let waiting = create(&f, t0()).await;
    assert_eq!(f.scheduler.tick(t0()).await.unwrap(), TickReport::default());
    assert_eq!(state(&f, &waiting).await.state, SessionState::Pending);
    lead.send_replace(true);
    assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
    assert_eq!(state(&f, &waiting).await.state, SessionState::Starting);
}

#[tokio::test]
async fn an_offline_node_gets_no_work_and_gives_back_starting_sessions() {
    let f = fixture(&[gpu(1), gpu(2)]).await;
    let running = create(&f, t0()).await;
    let starting = create(&f, t0()).await;
    assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 2);
    let ready = Change::keep_placement(SessionState::Waiting, t0(), "container running on node1");
    f.store.transition(running.id, ready).await.unwrap();

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
            requeued: 1,
            lost: 1,
            health: 0,
            jobs: 0,
            held: 0,
        }
    );
    let starting = state(&f, &starting).await;
    assert_eq!(starting.state, SessionState::Pending);
    assert_eq!(starting.reason, "node node1 stopped responding");
    assert_eq!(starting.node, None);
    let lost = state(&f, &running).await;
    assert_eq!(lost.state, SessionState::Failed);
    assert!(
        lost.reason.starts_with(
            "node lost: the agent of node1 has not synced since 2023-11-14 22:13:20 UTC \
             (node_timeout 30 seconds)"
        ),
        "{}",
        lost.reason
    );
    // It keeps its node, so the agent stops its container there when it is back.
    assert_eq!(lost.node.as_ref().map(|n| n.as_str()), Some("node1"));
    // Its GPU no longer counts as used.
    let site = SiteSnapshot::load(f.store.as_ref(), gone, TIMEOUT)
        .await
        .unwrap();
    assert_eq!(site.holding.len(), 0);
    // A second tick changes nothing more.
    assert_eq!(f.scheduler.tick(gone).await.unwrap(), TickReport::default());

    // When the node is back, the session is placed again.
    let node1 = NodeName::parse("node1").unwrap();
    assert!(f
        .store
        .record_sync(&node1, &[gpu(1), gpu(2)], gone)
        .await
        .unwrap()
        .is_some());
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
        let change = Change::keep_placement(to, t0(), reason);
        f.store.transition(session.id, change).await.unwrap();
    }
    // node1 stops responding; node2 has a free GPU.
    let gone = t0() + TimeDelta::seconds(31);
    let node2 = fixtures::registration("node2");
    f.store.register_node(node2, &[gpu(2)], gone).await.unwrap();
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
    let step = |to, reason: &str| Change::keep_placement(to, t0(), reason);
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
    let task = tokio::spawn(Arc::new(scheduler).run(Duration::from_secs(3600), shutdown.clone()));
    ticks.changed().await.unwrap(); // the interval's immediate first tick
    let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
    let new = fixtures::new_session(&owner, t0());
    let session = store.create_session(new).await.unwrap();
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

async fn alive(f: &Fixture, at: DateTime<Utc>) {
    let node = NodeName::parse("node1").unwrap();
    assert!(f
        .store
        .record_sync(&node, &[gpu(1)], at)
        .await
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn unhealthy_gpus_are_drained_and_their_work_stops_until_an_admin_undrains() {
    use ongrid_core::job::JobState;
    let mut f = fixture(&[gpu(1), gpu(2)]).await;
    let session = create(&f, t0()).await;
    let job = submit_job(&f, None, t0()).await;
    f.scheduler.tick(t0()).await.unwrap();
    assert_eq!(state(&f, &session).await.gpus, [GpuId::Gpu(gpu(1).uuid)]);
    assert_eq!(stored_job(&f, job).await.state(), JobState::Running);

    // The node reports GPU 1 failed and GPU 2 unknown (nvidia-smi hangs).
    let node1 = NodeName::parse("node1").unwrap();
    let failed = GpuInfo {
        health: GpuHealth::Failed("Xid 79: GPU has fallen off the bus".into()),
        ..gpu(1)
    };
    let unknown = GpuInfo {
        health: GpuHealth::Unknown("nvidia-smi did not answer".into()),
        ..gpu(2)
    };
    let at = t0() + TimeDelta::seconds(5);
    f.store
        .record_sync(&node1, &[failed, unknown], at)
        .await
        .unwrap();
    let report = f.scheduler.tick(at).await.unwrap();
    // Two drains, the session and the job.
    assert_eq!(report.health, 4);
    let session = state(&f, &session).await;
    assert_eq!(session.state, SessionState::Failed);
    assert!(
        session.reason.starts_with(
            "GPU GPU-11111111-2222-3333-4444-555555555501 is out of service (failed: Xid 79"
        ),
        "{}",
        session.reason
    );
    let halted = stored_job(&f, job).await;
    assert_eq!(halted.state(), JobState::Halted, "restartable: re-queued");
    assert!(halted.next_job.is_some());
    let nodes = f.store.nodes().await.unwrap();
    let drains: Vec<_> = nodes[0]
        .gpus
        .iter()
        .map(|g| g.drain.clone().unwrap())
        .collect();
    assert_eq!(drains[0].by, nodes::HEALTH_CHECK);
    assert_eq!(
        drains[0].reason,
        "failed: Xid 79: GPU has fallen off the bus"
    );
    assert_eq!(drains[1].reason, "unknown: nvidia-smi did not answer");
    assert_eq!(f.scheduler.tick(at).await.unwrap().health, 0, "done once");

    // Healthy again: they stay drained, and the re-queued job waits...
    f.store
        .record_sync(&node1, &[gpu(1), gpu(2)], at)
        .await
        .unwrap();
    assert_eq!(f.scheduler.tick(at).await.unwrap(), TickReport::default());
    assert!(f.store.nodes().await.unwrap()[0]
        .gpus
        .iter()
        .all(|g| g.drain.is_some()));
    // ...unless the site lifts the health check's drains itself.
    f.scheduler = Scheduler::new(
        f.store.clone(),
        Arc::new(ManualClock::new(at)),
        TIMEOUT,
        Arc::new(Notify::new()),
    )
    .with_auto_undrain(true);
    let report = f.scheduler.tick(at).await.unwrap();
    assert_eq!(report.health, 2);
    assert!(f.store.nodes().await.unwrap()[0]
        .gpus
        .iter()
        .all(|g| g.drain.is_none()));
    let next = stored_job(&f, halted.next_job.unwrap()).await;
    assert_eq!(next.state(), JobState::Running);
}

async fn submit_job(f: &Fixture, min_duration: Option<&str>, at: DateTime<Utc>) -> JobId {
    let user = f.store.user(&f.owner, 20_000).await.unwrap();
    let spec = ongrid_core::job::JobSpecFile {
        restartable: true,
        min_duration: min_duration.map(str::to_owned),
        ..Default::default()
    };
    let new = fixtures::job(&user, spec, None, at);
    f.store.create_job(new).await.unwrap().id
}

#[tokio::test]
async fn jobs_share_the_gpus_and_a_session_halts_one_past_its_min_duration() {
    use ongrid_core::job::{JobReason, JobState};
    let f = fixture(&[gpu(1)]).await;
    let job = submit_job(&f, Some("10 minutes"), t0()).await;
    assert_eq!(f.scheduler.tick(t0()).await.unwrap().jobs, 1);
    let running = stored_job(&f, job).await;
    assert_eq!(running.state(), JobState::Running);
    assert_eq!(running.gpus, vec![GpuId::Gpu(gpu(1).uuid)]);

    // Within its min duration the job keeps the GPU; the session waits.
    let session = create(&f, t0()).await;
    let early = t0() + TimeDelta::minutes(5);
    alive(&f, early).await;
    assert_eq!(
        f.scheduler.tick(early).await.unwrap(),
        TickReport::default()
    );
    assert_eq!(state(&f, &session).await.state, SessionState::Pending);

    // Past it, the session halts the job and waits for it to be HALTED.
    let later = t0() + TimeDelta::minutes(11);
    alive(&f, later).await;
    f.scheduler.tick(later).await.unwrap();
    let halting = stored_job(&f, job).await;
    assert_eq!(halting.state(), JobState::MustHalt);
    assert_eq!(
        halting.lifecycle.last().reason,
        JobReason::ForInteractiveSession {
            need: GpuRequest::default()
        }
    );
    assert_eq!(state(&f, &session).await.state, SessionState::Pending);
    assert_eq!(f.scheduler.tick(later).await.unwrap().placed, 0);

    let halted = jobs::JobChange {
        to: JobState::Halted,
        at: later,
        reason: JobReason::HaltedCleanly,
        place: None,
        exit_code: Some(123),
    };
    let next = jobs::next_in_chain(
        &halting,
        &halted,
        JobId::new_random(),
        &jobs::JobLimits::default(),
    )
    .unwrap();
    f.store
        .job_transition(job, halted, Some(next.clone()))
        .await
        .unwrap();
    let report = f.scheduler.tick(later).await.unwrap();
    assert_eq!(report.placed, 1);
    let placed = state(&f, &session).await;
    assert_eq!(placed.state, SessionState::Starting);
    assert!(
        placed.reason.ends_with("it preempted batch work"),
        "{}",
        placed.reason
    );
    // The re-queued job waits: the GPU is the session's now.
    let requeued = stored_job(&f, next.id).await;
    assert_eq!(requeued.state(), JobState::Queued);
    assert_eq!(requeued.chain.restart_count, 1);
}

/// A round stores every job start it plans, each on its own GPU, and tells the jobs' node of
/// each; a job no GPU is left for waits.
#[tokio::test]
async fn a_round_starts_every_job_it_can_and_tells_their_node() {
    use crate::notify::Changed;
    use ongrid_core::job::JobState;
    let mut f = fixture(&[gpu(1), gpu(2), gpu(3)]).await;
    let (changes, mut told) = Changes::new(CancellationToken::new()).with_outbox();
    f.scheduler = f.scheduler.with_changes(changes);
    let mut submitted = Vec::new();
    for i in 0..4 {
        submitted.push(submit_job(&f, None, t0() + TimeDelta::seconds(i)).await);
    }
    let report = f
        .scheduler
        .tick(t0() + TimeDelta::seconds(5))
        .await
        .unwrap();
    assert_eq!(report.jobs, 3, "{report:?}");
    let node1 = NodeName::parse("node1").unwrap();
    let mut gpus = Vec::new();
    for (i, id) in submitted.iter().enumerate() {
        let job = stored_job(&f, *id).await;
        if i < 3 {
            assert_eq!(job.state(), JobState::Running, "job {i}");
            assert_eq!(job.node.as_ref(), Some(&node1));
            gpus.extend(job.gpus.clone());
        } else {
            assert_eq!(job.state(), JobState::Queued, "the last in the queue waits");
        }
    }
    gpus.sort_by_key(ToString::to_string);
    let all: Vec<GpuId> = [1, 2, 3].map(|n| GpuId::Gpu(gpu(n).uuid)).into();
    assert_eq!(gpus, all);
    let mut notified = Vec::new();
    while let Ok(changed) = told.try_recv() {
        notified.push(changed);
    }
    assert_eq!(notified, vec![Changed::Node(node1); 3]);
}

#[tokio::test]
async fn a_job_on_a_node_that_stopped_responding_is_requeued_when_restartable() {
    use ongrid_core::job::JobState;
    let f = fixture(&[gpu(1)]).await;
    let job = submit_job(&f, None, t0()).await;
    f.scheduler.tick(t0()).await.unwrap();
    let gone = t0() + TimeDelta::seconds(31);
    assert_eq!(f.scheduler.tick(gone).await.unwrap().jobs, 1);
    let lost = stored_job(&f, job).await;
    assert_eq!(lost.state(), JobState::Halted);
    assert_eq!(
        lost.lifecycle.last().reason.to_string(),
        "node node1 was lost: re-queued (restartable)"
    );
    let next = stored_job(&f, lost.next_job.unwrap()).await;
    assert_eq!(next.state(), JobState::Queued);
    // Its checkpoint is on node1, which is gone: the next round fails it, saying so.
    assert_eq!(
        next.pinned_node.as_ref().map(NodeName::as_str),
        Some("node1")
    );
    assert_eq!(f.scheduler.tick(gone).await.unwrap().jobs, 1);
    let failed = stored_job(&f, next.id).await;
    assert_eq!(failed.state(), JobState::Failed);
    assert!(
        failed
            .lifecycle
            .last()
            .reason
            .to_string()
            .starts_with("its checkpoint (the chain's working directory) is on node node1"),
        "{}",
        failed.lifecycle.last().reason
    );
}

#[tokio::test]
async fn with_a_shared_work_dir_a_requeued_job_may_start_anywhere() {
    use ongrid_core::job::JobState;
    let mut f = fixture(&[gpu(1)]).await;
    f.scheduler = f.scheduler.with_job_limits(jobs::JobLimits {
        shared_work_dir: true,
        ..jobs::JobLimits::default()
    });
    let job = submit_job(&f, None, t0()).await;
    f.scheduler.tick(t0()).await.unwrap();
    let gone = t0() + TimeDelta::seconds(31);
    f.scheduler.tick(gone).await.unwrap();
    let lost = stored_job(&f, job).await;
    let next = stored_job(&f, lost.next_job.unwrap()).await;
    assert_eq!(next.pinned_node, None);
    f.scheduler.tick(gone).await.unwrap();
    let waiting = stored_job(&f, next.id).await;
    assert_eq!(waiting.state(), JobState::Queued);
}

/// The loop's round stores its changes at the time it starts: one that waited for the round
/// under way (a request's) does not date them from before it began.
#[tokio::test]
async fn the_loops_round_takes_its_time_once_it_starts() {
    let (_dir, store) = fixtures::sqlite().await;
    let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
    store.user(&owner, 20_000).await.unwrap();
    store
        .register_node(fixtures::registration("node1"), &[gpu(1)], t0())
        .await
        .unwrap();
    let clock = Arc::new(ManualClock::new(t0()));
    let wake = Arc::new(Notify::new());
    let scheduler = Arc::new(Scheduler::new(
        store.clone(),
        clock.clone(),
        TIMEOUT,
        wake.clone(),
    ));
    let session = store
        .create_session(fixtures::new_session(&owner, t0()))
        .await
        .unwrap();
    let under_way = scheduler.tick_lock.lock().await;
    let mut ticks = scheduler.ticks();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(
        scheduler
            .clone()
            .run(Duration::from_secs(3600), shutdown.clone()),
    );
    // Woken (as a request does) before it first looks; this test's runtime has one thread: the
    // loop runs its tick until it waits for the round under way.
    wake.notify_one();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    clock.advance(TimeDelta::seconds(10));
    drop(under_way);
    ticks.changed().await.unwrap();
    shutdown.cancel();
    running.await.unwrap();
    let placed = store.transitions(session.id).await.unwrap();
    let starting = placed
        .iter()
        .find(|t| t.to == SessionState::Starting)
        .expect("placed by the loop's round");
    assert_eq!(starting.at, t0() + TimeDelta::seconds(10));
}
