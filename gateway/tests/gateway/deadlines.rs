//! The session lifecycle at the gateway: the deadlines banner of interactive shells (and its
//! absence everywhere else), `activity` reports while a connection is open, and the one-time
//! warning before a planned hold.

use std::process::Stdio;
use std::sync::{Arc, Mutex};

use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
use ongrid_core::holds::{HoldReason, PlannedHold};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};
use tokio::task::JoinHandle;

use crate::harness::{eventually, explain, run, text, Env, Options};

const BANNER: &str = "ongrid: session train1 on node1 · held if idle for 2 h · ends at ";
const WARNING: &str = "ongrid: session train1 will be held at ";

/// `ssh -tt train1@gateway` with no command: an interactive shell with a terminal (the fake
/// agent's shell echoes its input), its stdin kept open and its output collected as it comes.
struct Shell {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// The tasks copying stdout and stderr; they end at the end of the pipes.
    collectors: Vec<JoinHandle<()>>,
}

impl Shell {
    fn start(env: &Env) -> Self {
        let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
        ssh.arg("-tt")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = ssh.spawn().expect("spawn ssh");
        let collect = |mut from: Box<dyn tokio::io::AsyncRead + Send + Unpin>| {
            let into = Arc::new(Mutex::new(Vec::new()));
            let sink = into.clone();
            let task = tokio::spawn(async move {
                let mut buffer = vec![0u8; 4096];
                while let Ok(n) = from.read(&mut buffer).await {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap().extend_from_slice(&buffer[..n]);
                }
            });
            (into, task)
        };
        let (stdout, out_task) = collect(Box::new(child.stdout.take().expect("stdout")));
        let (stderr, err_task) = collect(Box::new(child.stderr.take().expect("stderr")));
        Self {
            stdin: child.stdin.take(),
            child,
            stdout,
            stderr,
            collectors: vec![out_task, err_task],
        }
    }

    async fn type_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(line.as_bytes()).await.unwrap();
        stdin.flush().await.unwrap();
    }

    fn stdout(&self) -> String {
        text(&self.stdout.lock().unwrap())
    }

    fn stderr(&self) -> String {
        text(&self.stderr.lock().unwrap())
    }

    /// Closes stdin (the shell ends) and waits for ssh.
    async fn finish(mut self) -> (String, String) {
        drop(self.stdin.take());
        let status = tokio::time::timeout(std::time::Duration::from_secs(30), self.child.wait())
            .await
            .expect("ssh ends within 30 s")
            .unwrap();
        // ssh is gone: the collectors reach the end of its pipes.
        for collector in std::mem::take(&mut self.collectors) {
            tokio::time::timeout(std::time::Duration::from_secs(10), collector)
                .await
                .expect("ssh's pipes end with it")
                .unwrap();
        }
        assert!(
            status.success(),
            "{status}: {} / {}",
            self.stdout(),
            self.stderr()
        );
        (self.stdout(), self.stderr())
    }
}

fn of_kind(events: &[ConnectionEvent], kind: ConnectionEventKind) -> usize {
    events.iter().filter(|e| e.event == kind).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_shell_gets_the_banner_and_nothing_else_does() {
    let env = Env::start(Options::default()).await;
    let mut shell = Shell::start(&env);
    shell.type_line("hello\n").await;
    eventually("the shell's echo", || async {
        shell.stdout().contains("hello").then_some(())
    })
    .await;
    let (_, stderr) = shell.finish().await;
    assert!(stderr.contains(BANNER), "{stderr}");
    assert!(
        stderr.contains("devctl session show train1 for details\r\n"),
        "{stderr}"
    );
    assert_eq!(stderr.matches("ongrid:").count(), 1, "{stderr}");
    assert!(!stderr.contains(WARNING), "no hold planned: {stderr}");

    // Commands, with or without a terminal, and subsystems carry protocols: never a word added.
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert!(out.status.success(), "{}", explain(&out));
    assert_eq!(text(&out.stderr), "", "{}", explain(&out));
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args(["-tt", "env"]);
    let out = run(ssh, b"").await;
    assert!(out.status.success(), "{}", explain(&out));
    assert!(!text(&out.stderr).contains("ongrid"), "{}", explain(&out));
    assert!(!text(&out.stdout).contains("ongrid"), "{}", explain(&out));
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args(["-s", "sftp"]);
    let out = run(ssh, b"raw sftp bytes").await;
    assert_eq!(text(&out.stdout), "raw sftp bytes", "{}", explain(&out));
    assert_eq!(text(&out.stderr), "", "{}", explain(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_without_deadlines_means_no_banner() {
    let env = Env::start(Options::default()).await;
    *env.manager.deadlines.lock().unwrap() = None; // answers 204, like before
    let mut shell = Shell::start(&env);
    shell.type_line("hello\n").await;
    eventually("the shell's echo", || async {
        shell.stdout().contains("hello").then_some(())
    })
    .await;
    let (_, stderr) = shell.finish().await;
    assert!(!stderr.contains("ongrid:"), "{stderr}");
    let events = eventually("open and close", || async {
        let events = env.manager.events();
        (of_kind(&events, ConnectionEventKind::Close) == 1).then_some(events)
    })
    .await;
    assert_eq!(events[0].event, ConnectionEventKind::Open);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_connections_report_their_traffic_until_they_close() {
    let env = Env::start(Options {
        activity_report: Some("1 second"),
        ..Options::default()
    })
    .await;
    let mut shell = Shell::start(&env);
    shell.type_line("abc\n").await;
    // Two reports that carry the typed bytes: the connection stays open meanwhile.
    eventually("two activity reports with the typed bytes", || async {
        let events = env.manager.events();
        let carrying = events
            .iter()
            .filter(|e| e.event == ConnectionEventKind::Activity && e.bytes_in >= 4)
            .count();
        (carrying >= 2).then_some(())
    })
    .await;
    shell.finish().await;
    let events = eventually("the close", || async {
        let events = env.manager.events();
        (of_kind(&events, ConnectionEventKind::Close) == 1).then_some(events)
    })
    .await;
    // Open, the activity reports, close; one connection; totals never go down.
    assert_eq!(events[0].event, ConnectionEventKind::Open);
    assert_eq!(events.last().unwrap().event, ConnectionEventKind::Close);
    assert!(events[1..events.len() - 1]
        .iter()
        .all(|e| e.event == ConnectionEventKind::Activity));
    assert!(events
        .iter()
        .all(|e| e.connection_id == events[0].connection_id));
    assert!(events
        .windows(2)
        .all(|w| w[0].bytes_in <= w[1].bytes_in && w[0].bytes_out <= w[1].bytes_out));
    assert!(events.windows(2).all(|w| w[0].at <= w[1].at));
    let close = events.last().unwrap();
    assert_eq!(close.bytes_in, 4);
    assert_eq!(close.session_id, env.train1.session_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_hold_is_announced_once_to_interactive_shells() {
    let env = Env::start(Options {
        activity_report: Some("1 second"),
        ..Options::default()
    })
    .await;
    // A hold far away: the banner, no warning.
    env.manager.plan_hold(Some(PlannedHold {
        at: chrono::Utc::now() + chrono::Duration::hours(2),
        reason: HoldReason::Idle,
    }));
    let mut shell = Shell::start(&env);
    let mut other = Shell::start(&env);
    shell.type_line("one\n").await;
    eventually("the banner", || async {
        shell.stderr().contains(BANNER).then_some(())
    })
    .await;
    // A command on its own connection meanwhile: it must never see the warning.
    let mut quiet = env.ssh(&env.alice, "train1", env.gateway.port());
    quiet.arg("count");
    quiet
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut quiet = quiet.spawn().unwrap();

    // The manager now plans a hold within ten minutes: the next answer brings it.
    env.manager.plan_hold(Some(PlannedHold {
        at: chrono::Utc::now() + chrono::Duration::minutes(5),
        reason: HoldReason::MaxDuration,
    }));
    eventually("the warning in both shells", || async {
        (shell.stderr().contains(WARNING) && other.stderr().contains(WARNING)).then_some(())
    })
    .await;
    // More answers with the same hold: no second warning.
    let seen = env.manager.events().len();
    eventually("more activity reports", || async {
        let events = env.manager.events();
        (of_kind(&events[seen..], ConnectionEventKind::Activity) >= 6).then_some(())
    })
    .await;
    shell.type_line("two\n").await;
    other.type_line("three\n").await;
    eventually("the echoes", || async {
        (shell.stdout().contains("two") && other.stdout().contains("three")).then_some(())
    })
    .await;
    let (stdout, stderr) = shell.finish().await;
    let (_, other_stderr) = other.finish().await;
    drop(quiet.stdin.take());
    let quiet = quiet.wait_with_output().await.unwrap();

    for stderr in [&stderr, &other_stderr] {
        assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
        assert!(
            stderr.contains(
                "(in 4 min, max-duration): save your work: the maximum duration cannot be extended"
            ) || stderr.contains(
                "(in 5 min, max-duration): save your work: the maximum duration cannot be extended"
            ),
            "{stderr}"
        );
        assert!(stderr.contains("devctl freeze train1"), "{stderr}");
    }
    assert!(
        !stdout.contains("ongrid"),
        "the warning goes to stderr: {stdout}"
    );
    assert_eq!(text(&quiet.stdout), "0\n", "{}", explain(&quiet));
    assert_eq!(text(&quiet.stderr), "", "{}", explain(&quiet));
}
