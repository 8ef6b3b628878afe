//! Two manager processes against one PostgreSQL database (a real server the test starts): the
//! second is a standby that binds nothing while the first is active, and serves as soon as the
//! first is killed with SIGKILL; what the first decided (a hold, a placement) is all there, and
//! the GPU the first handed out is not handed out again.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use ongrid_core::api::RunState;
use ongrid_core::holds::HoldRequest;
use ongrid_core::GpuId;

use super::*;

#[path = "../../src/store/test_server.rs"]
#[allow(dead_code)]
mod test_server;

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

#[tokio::test]
async fn a_standby_manager_serves_when_the_active_one_is_killed_with_nothing_lost_or_doubled() {
    let site = Site::new();
    let database = test_server::fresh_database().await;
    let text = std::fs::read_to_string(&site.config.path).unwrap();
    let sqlite_line = format!(
        "database = \"{}\"",
        path(&site.dir.path().join("manager.db"))
    );
    assert!(text.contains(&sqlite_line), "{text}");
    let text = text
        .replace(&sqlite_line, &format!("database = \"{database}\""))
        .replace(
            "schedule_interval = \"1 hour\"",
            "schedule_interval = \"1 second\"",
        )
        + &format!(
            "[jobs]\nlog_dir = \"{}\"\n",
            path(&site.dir.path().join("jobs"))
        );
    let config = site.dir.path().join("postgres.toml");
    std::fs::write(&config, text).unwrap();

    let (mut first, announced) = spawn_manager(&config);
    let addr = tokio::time::timeout(Duration::from_secs(30), announced)
        .await
        .expect("the first manager did not start within 30 s")
        .unwrap();
    let m = site.running(
        addr,
        CancellationToken::new(),
        tokio::spawn(async { Ok(()) }),
    );
    m.node1.register("node1", vec![a100(1)]).await;
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
    m.alice.create(Some("placed"), one_gpu()).await;
    let placed = m.alice.wait_for("placed", SessionState::Starting).await;

    let (mut second, mut second_announced) = spawn_manager(&config);
    assert!(
        tokio::time::timeout(Duration::from_secs(2), &mut second_announced)
            .await
            .is_err(),
        "a second manager serves while the first one is active"
    );

    let killed_at = Instant::now();
    first.kill().unwrap();
    first.wait().unwrap();
    let addr = tokio::time::timeout(Duration::from_secs(10), second_announced)
        .await
        .expect("the standby did not take over within 10 s")
        .unwrap();
    let handover = killed_at.elapsed();
    assert!(
        handover < Duration::from_secs(5),
        "handover took {handover:?}"
    );

    let m = site.running(
        addr,
        CancellationToken::new(),
        tokio::spawn(async { Ok(()) }),
    );
    let held = m.alice.show("held").await;
    assert_eq!(held.state, SessionState::Held, "{}", held.reason);
    let still = m.alice.show("placed").await;
    assert_eq!(
        (still.state, &still.node, &still.gpus),
        (SessionState::Starting, &placed.node, &placed.gpus)
    );
    // Released, the held session waits: the only GPU is the other session's.
    let released: SessionView = m
        .alice
        .ok(
            StatusCode::OK,
            m.alice
                .post("/v1/sessions/held/release", &serde_json::json!({})),
        )
        .await;
    assert_eq!(released.state, SessionState::Pending, "{}", released.reason);
    let desired = m.node1.sync("node1", vec![a100(1)], Vec::new()).await;
    let runs: Vec<(&str, RunState, &[GpuId])> = desired
        .sessions
        .iter()
        .map(|s| (s.name.as_str(), s.run, s.gpus.as_slice()))
        .collect();
    assert_eq!(
        runs,
        [
            ("held", RunState::Stopped, placed.gpus.as_slice()),
            ("placed", RunState::Running, placed.gpus.as_slice())
        ],
        "one GPU, one running container"
    );
    assert_eq!(m.alice.show("held").await.state, SessionState::Pending);

    second.kill().unwrap();
    second.wait().unwrap();
}
