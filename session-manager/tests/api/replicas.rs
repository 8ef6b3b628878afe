//! Several managers on one PostgreSQL database (a real server the test starts), and moving a
//! store to PostgreSQL and back from a backup:
//! - two manager processes both serve; the first leads (places sessions, runs the hold timer),
//!   the second wakes it and answers with its placement; an agent's long-poll on the second is
//!   woken by a placement the first made; the first killed with SIGKILL, the second leads within
//!   [`HANDOVER`], applies the hold the first had planned, and no GPU is handed out twice;
//! - `ongrid-manager copy-store` copies a SQLite store into an empty PostgreSQL database (and
//!   refuses a database that is not empty), the manager serves the copy, and a `pg_dump` of it
//!   restored with `pg_restore` into a new database serves the same; `mark-restored` raises
//!   the restored store's generation, and a manager left on the copy is refused by a client
//!   of both (with words naming it and the fix) and, told so by that client, stops leading.

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use ongrid_core::api::RunState;
use ongrid_core::holds::{HoldReason, HoldRequest};
use ongrid_core::GpuId;
use ongrid_manager::store::Database;

use super::watch::{long_poll, register_versioned};
use super::*;

#[path = "../../src/store/test_server.rs"]
#[allow(dead_code)]
mod test_server;

/// The longest a follower may take to lead once the leader's process is killed: the manager
/// lock is free at once, the follower waits `TAKEOVER_GRACE` (3 s), then runs its first round.
const HANDOVER: Duration = Duration::from_secs(5);

/// The manager binary with `config`, its first line of output (`listening on ADDR`) sent on the
/// returned channel when it comes.
fn spawn_manager(config: &Path) -> (Child, tokio::sync::oneshot::Receiver<SocketAddr>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ongrid-manager"))
        .args(["--config", &path(config)])
        .env("ONGRID_MANAGER_LISTEN", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (announce, announced) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        if std::io::BufReader::new(stdout).read_line(&mut line).is_ok() {
            if let Some(addr) = line.trim().strip_prefix("listening on ") {
                announce.send(addr.parse().unwrap()).ok();
            }
        }
    });
    (child, announced)
}

/// Starts a manager process and waits for its address.
async fn start_manager(config: &Path) -> (Child, SocketAddr) {
    let (child, announced) = spawn_manager(config);
    let addr = tokio::time::timeout(Duration::from_secs(30), announced)
        .await
        .expect("a manager did not start within 30 s")
        .unwrap();
    (child, addr)
}

/// The site's config file with `database` instead of its SQLite file, a `[jobs] log_dir` (the
/// replicas share it) and `extra` appended.
fn postgres_config(site: &Site, database: &str, extra: &str) -> PathBuf {
    let text = std::fs::read_to_string(&site.config.path).unwrap();
    let sqlite_line = format!(
        "database = \"{}\"",
        path(&site.dir.path().join("manager.db"))
    );
    assert!(text.contains(&sqlite_line), "{text}");
    let text = text.replace(&sqlite_line, &format!("database = \"{database}\""))
        + &format!(
            "[jobs]\nlog_dir = \"{}\"\n",
            path(&site.dir.path().join("jobs"))
        )
        + extra;
    let config = site.dir.path().join("postgres.toml");
    std::fs::write(&config, text).unwrap();
    config
}

/// Whose GPUs a node's desired state hands out: each GPU to one running session at most.
fn assert_no_gpu_twice(desired: &DesiredState) {
    let mut seen = BTreeSet::new();
    for session in desired
        .sessions
        .iter()
        .filter(|s| s.run == RunState::Running)
    {
        for gpu in &session.gpus {
            assert!(
                seen.insert(gpu.clone()),
                "{gpu:?} handed out twice: {desired:?}"
            );
        }
    }
}

/// How often a session was placed (went to STARTING).
fn placements(view: &SessionView) -> usize {
    view.transitions
        .iter()
        .filter(|t| t.to == SessionState::Starting)
        .count()
}

#[tokio::test]
async fn two_replicas_serve_and_the_second_leads_when_the_first_is_killed() {
    let site = Site::new();
    let database = test_server::fresh_database().await;
    // The scheduler's own interval is an hour: only wake-ups place, across replicas too. A
    // started session nobody connects to is held after 10 s.
    let config = postgres_config(
        &site,
        &database,
        "[lifecycle]\nconnect_deadline = \"10 seconds\"\nstartup_grace = \"1 second\"\n",
    );
    let gpus = vec![a100(1), a100(2), a100(3), a100(4)];

    let (mut first, a) = start_manager(&config).await;
    let a = site.running(a, CancellationToken::new(), tokio::spawn(async { Ok(()) }));
    a.node1.register("node1", gpus.clone()).await;
    a.alice.create(Some("one"), one_gpu()).await;
    // The first replica leads once its takeover grace is over.
    let one = a.alice.wait_for("one", SessionState::Starting).await;

    let (mut second, b) = start_manager(&config).await;
    let b = site.running(b, CancellationToken::new(), tokio::spawn(async { Ok(()) }));
    assert_eq!(b.alice.show("one").await.gpus, one.gpus, "both serve");

    // The node's long-poll on the second replica, woken by a placement the first one makes.
    let version = register_versioned(&b.node1, "node1", gpus.clone()).await;
    let poll = long_poll(&b.node1, &version, 60);
    // No event says when the request reached the second replica: give it a moment, so that the
    // answer below comes from the wake-up, not from a version already old on arrival.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    let two = a.alice.create(Some("two"), one_gpu()).await;
    assert_eq!(two.state, SessionState::Starting, "{}", two.reason);
    let (status, _, desired) = tokio::time::timeout(Duration::from_secs(5), poll)
        .await
        .expect("the second replica's long-poll was not woken within 5 s")
        .unwrap();
    let woken = asked.elapsed();
    assert_eq!(status, StatusCode::OK);
    let desired = desired.unwrap();
    assert!(
        desired.sessions.iter().any(|s| s.name.as_str() == "two"),
        "{desired:?}"
    );
    println!("long-poll on the follower woken {woken:?} after the leader was asked");

    // Asked of the follower, a session is placed by the leader and the answer says so.
    let three = b.alice.create(Some("three"), one_gpu()).await;
    assert_eq!(three.state, SessionState::Starting, "{}", three.reason);
    // One that no free GPU meets waits: the follower answers PENDING as soon as the leader
    // says its round for it has ended, not when its wait for the leader runs out.
    let asked = Instant::now();
    let two_gpus = GpuRequest {
        count: 2,
        ..one_gpu()
    };
    let wide = b.alice.create(Some("wide"), two_gpus).await;
    let answered = asked.elapsed();
    assert_eq!(wide.state, SessionState::Pending, "{}", wide.reason);
    assert!(
        answered < PLACEMENT_WAIT,
        "answered after {answered:?}: the leader never said its round had ended"
    );
    let _: SessionView = b
        .alice
        .ok(StatusCode::OK, b.alice.delete("/v1/sessions/wide"))
        .await;

    // "two" runs; nobody connects: the first replica plans its hold in 10 s, but dies first.
    let desired = b
        .node1
        .sync(
            "node1",
            gpus.clone(),
            vec![container(&two, ContainerState::Running, None)],
        )
        .await;
    assert_no_gpu_twice(&desired);
    let two = b.alice.wait_for("two", SessionState::Waiting).await;
    let _: SessionView = b
        .alice
        .ok(
            StatusCode::OK,
            b.alice
                .post("/v1/sessions/one/hold", &HoldRequest { reason: None }),
        )
        .await;

    let killed_at = Instant::now();
    first.kill().unwrap();
    first.wait().unwrap();
    // Asked right away, the follower answers PENDING or STARTING; it is placed once it leads.
    b.alice.create(Some("four"), one_gpu()).await;
    let four = b.alice.wait_for("four", SessionState::Starting).await;
    let handover = killed_at.elapsed();
    println!("the follower placed a session {handover:?} after the leader was killed");
    assert!(handover < HANDOVER, "handover took {handover:?}");

    // The hold the first replica had planned, applied by the second.
    let held = b.alice.wait_for("two", SessionState::Held).await;
    let hold = held.transitions.last().unwrap();
    assert!(hold.at > two.transitions.last().unwrap().at);
    assert!(
        held.reason.starts_with(HoldReason::NoConnection.as_str()),
        "{}",
        held.reason
    );

    // Nothing placed twice, no GPU handed out twice.
    for name in ["one", "three", "four"] {
        assert_eq!(placements(&b.alice.show(name).await), 1, "{name}");
    }
    assert_eq!(placements(&held), 1);
    let desired = b.node1.sync("node1", gpus.clone(), Vec::new()).await;
    assert_no_gpu_twice(&desired);
    let running: BTreeSet<&str> = desired
        .sessions
        .iter()
        .filter(|s| s.run == RunState::Running)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(running, BTreeSet::from(["three", "four"]));
    let gpus_of_four: &[GpuId] = &four.gpus;
    assert!(!three.gpus.iter().any(|g| gpus_of_four.contains(g)));

    second.kill().unwrap();
    second.wait().unwrap();
}

/// `pg_dump` and `pg_restore` of the test server's version.
fn pg_tool(name: &str) -> PathBuf {
    let tool = test_server::binaries()
        .unwrap_or_else(|e| panic!("{e}"))
        .join(name);
    assert!(tool.is_file(), "{} missing", tool.display());
    tool
}

/// What the test compares between the stores: each of alice's sessions with its history.
async fn alice_sessions(m: &Running) -> Vec<(String, SessionState, Vec<GpuId>, usize)> {
    let mut sessions: Vec<_> = m
        .alice
        .list("")
        .await
        .into_iter()
        .map(|s| (s.name.to_string(), s.state, s.gpus.clone(), 0))
        .collect();
    for session in &mut sessions {
        session.3 = m.alice.show(&session.0).await.transitions.len();
    }
    sessions.sort_by(|x, y| x.0.cmp(&y.0));
    sessions
}

#[tokio::test]
async fn a_sqlite_store_copied_into_postgres_serves_and_survives_a_backup_and_restore() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1), a100(2)]).await;
    m.alice.create(Some("placed"), one_gpu()).await;
    let placed = m.alice.wait_for("placed", SessionState::Starting).await;
    m.alice.create(Some("held"), one_gpu()).await;
    m.alice.wait_for("held", SessionState::Starting).await;
    let _: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/held/hold", &HoldRequest { reason: None }),
        )
        .await;
    m.alice.create(Some("waiting"), one_gpu()).await;
    let before = alice_sessions(&m).await;
    assert_eq!(before.len(), 3);
    m.stop().await;

    let copy = |to: &str| {
        Command::new(env!("CARGO_BIN_EXE_ongrid-manager"))
            .args(["copy-store", "--from"])
            .arg(site.dir.path().join("manager.db"))
            .args(["--to", to])
            .output()
            .unwrap()
    };
    let database = test_server::fresh_database().await;
    let output = copy(&database);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("sessions: 3 rows"), "{stdout}");
    assert!(stdout.contains("as the store's generation 2"), "{stdout}");
    let again = copy(&database);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("is not empty"), "{stderr}");
    assert!(stderr.contains("new, empty database"), "{stderr}");

    let mut config = site.config.clone();
    config.store = Database::parse(&database).unwrap();
    let m = site.start_with(config.clone(), None).await;
    assert_eq!(alice_sessions(&m).await, before, "the copy serves the same");
    assert_eq!(m.alice.show("placed").await.gpus, placed.gpus);
    m.stop().await;

    // Backup and restore: pg_dump in its custom format, restored into a new database.
    let dump = site.dir.path().join("manager.pgdump");
    let output = Command::new(pg_tool("pg_dump"))
        .args(["--format=custom", "--no-owner", "--file"])
        .arg(&dump)
        .arg(format!("--dbname={database}"))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let restored = test_server::fresh_database().await;
    let output = Command::new(pg_tool("pg_restore"))
        .args(["--no-owner", "--exit-on-error"])
        .arg(format!("--dbname={restored}"))
        .arg(&dump)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "pg_restore: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = Command::new(env!("CARGO_BIN_EXE_ongrid-manager"))
        .args(["mark-restored", "--database", &restored])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("is now at generation 3"), "{stdout}");
    let copy_config = config.clone();
    config.store = Database::parse(&restored).unwrap();
    let m = site.start_with(config, None).await;
    assert_eq!(
        alice_sessions(&m).await,
        before,
        "the restore serves the same"
    );

    let released: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/held/release", &serde_json::json!({})),
        )
        .await;
    assert_ne!(released.state, SessionState::Held, "{}", released.reason);
    a_manager_left_on_the_copy_is_refused(&site, &m, copy_config).await;
    m.stop().await;
}

/// The `Ongrid-Store` header of an answer of `m`.
async fn store_header(m: &Running) -> String {
    let response = m.alice.get("/v1/sessions").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    response
        .headers()
        .get(ongrid_core::store_identity::STORE_HEADER)
        .expect("every answer names its store")
        .to_str()
        .unwrap()
        .to_owned()
}

/// `restored` serves generation 3 of the store; a manager started on the copy it was dumped
/// from (generation 2: its `database` missed after the restore) leads that copy alone, until a
/// client of both that saw generation 3 reaches it: the client refuses its answer, naming it and
/// the fix, and the manager, told what the client saw, stops leading.
async fn a_manager_left_on_the_copy_is_refused(site: &Site, restored: &Running, copy: Config) {
    use ongrid_service::manager_http::{Failure, Managers};

    let left = site.start_with(copy, None).await;
    let served = store_header(restored).await;
    let (id, generation) = served.rsplit_once('.').unwrap();
    assert_eq!(generation, "3");
    assert_eq!(store_header(&left).await, format!("{id}.2"));
    // Alone on its copy, the one left behind leads it.
    left.node1
        .register("node1", vec![a100(1), a100(2), a100(3), a100(4)])
        .await;
    left.alice.create(Some("early"), one_gpu()).await;
    left.alice.wait_for("early", SessionState::Starting).await;

    let url = |m: &Running| reqwest::Url::parse(&format!("https://{}/", m.addr)).unwrap();
    let managers = Managers::new(&[url(restored), url(&left)]).unwrap();
    let http = restored.alice.client.clone();
    let call = || async {
        let request = http
            .get(managers.url("v1/sessions").unwrap())
            .build()
            .unwrap();
        managers.execute(&http, request, true).await
    };
    let (answered, _) = call().await.unwrap();
    assert_eq!(answered.port(), Some(restored.addr.port()));
    let restored_addr = restored.addr;
    // The caller waits for `restored` to stop; here it stops answering.
    restored.shutdown.cancel();
    let refused = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match call().await {
                Ok((answered, _)) => assert_eq!(answered.port(), Some(restored_addr.port())),
                Err(no_manager) => break no_manager,
            }
        }
    })
    .await
    .expect("the restored manager stops answering within 20 s");
    let Failure::StaleStore(sentence) = &refused.failure else {
        panic!("{refused:?}");
    };
    assert_eq!(
        sentence,
        &format!(
            "manager https://{} serves an older copy of the store (generation 2, others serve \
             3): its `database` setting was missed after a restore; fix its manager.toml and \
             restart it",
            left.addr
        )
    );

    // Told by that client, the manager on the copy no longer leads: nothing new is placed.
    let late = left.alice.create(Some("late"), one_gpu()).await;
    assert_eq!(late.state, SessionState::Pending, "{}", late.reason);
    left.stop().await;
}
