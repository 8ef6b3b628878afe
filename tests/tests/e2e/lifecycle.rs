//! The session lifecycle with the real binaries, Docker and OpenSSH, timeouts in seconds:
//! a session nobody connects to is HELD (container stopped, GPU freed for a waiting session),
//! release brings back the same container with its files, an idle session is held while one
//! running a busy process in tmux is not (and the tmux session is there on reconnect), an open
//! connection that sends nothing does not keep a session while one running a busy command does,
//! and a hold that fell due while the manager was down is applied once when it is back.

use std::process::Output;
use std::time::{Duration, Instant};

use ongrid_e2e::{docker_exec, inspect_container, SimGpu, Site, User};
use serde_json::Value;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn explain(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    )
}

fn show(site: &Site, user: &User, name: &str) -> Value {
    site.devctl_json(user, &["session", "show", name])
        .unwrap_or_else(|e| panic!("devctl session show {name}: {e}\n{}", site.logs()))
}

fn container_running(name: &str) -> Option<bool> {
    inspect_container(name).and_then(|c| c["State"]["Running"].as_bool())
}

/// Runs ssh until it succeeds (the allowlist reaches the gateway within its refresh interval).
fn ssh_eventually(site: &Site, user: &User, target: &str, command: &str) -> Output {
    site.wait_until("ssh to succeed", Duration::from_secs(30), || {
        let out = site.ssh(user, target, command, b"");
        out.status.success().then_some(out)
    })
}

fn holds(view: &Value) -> usize {
    view["transitions"]
        .as_array()
        .map(|ts| ts.iter().filter(|t| t["to"] == "HELD").count())
        .unwrap_or(0)
}

#[test]
fn a_session_nobody_connects_to_is_held_and_released_into_the_same_container() {
    let mut site = Site::start_with_lifecycle(
        &[SimGpu::a100(1)],
        "connect_deadline = \"6s\"\nstartup_grace = \"1s\"\nidle_timeout = \"1 hour\"",
    );
    let alice = site.user("Alice");
    let bob = site.user("Bob");
    site.devctl_ok(&alice, &["session", "new", "--name", "first", "--wait"]);
    let first = show(&site, &alice, "first");
    let container = first["container"].as_str().expect("container").to_owned();
    let container_id = inspect_container(&container).expect("the container exists")["Id"].clone();
    let (code, _) = docker_exec(
        &container,
        &["sh", "-c", "echo kept-across-the-hold > /tmp/ongrid-marker"],
    );
    assert_eq!(code, 0, "writing the marker file");

    // Bob waits for the only GPU.
    site.devctl_ok(&bob, &["session", "new", "--name", "second"]);
    assert_eq!(show(&site, &bob, "second")["state"], "PENDING");

    // Nobody connects to Alice's session: HELD, its container stopped, the GPU goes to Bob.
    let held = site.wait_for_state(&alice, "first", "HELD");
    let reason = held["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("no-connection: nobody connected within 6 seconds"),
        "{reason}"
    );
    assert!(
        held["lifecycle"].is_object(),
        "a HELD session shows its lifecycle"
    );
    site.wait_for_state(&bob, "second", "WAITING");
    site.wait_until(
        "the held container to stop",
        Duration::from_secs(60),
        || (container_running(&container) == Some(false)).then_some(()),
    );
    let stopped = inspect_container(&container).expect("a held container is kept");
    assert_eq!(stopped["Id"], container_id);

    // Release: its node has no GPU free, so it waits in the queue, pinned to that node.
    let released = site.devctl_ok(&alice, &["session", "release", "first"]);
    assert!(
        released.contains("released: PENDING at position 1 in the queue"),
        "{released}"
    );
    let pending = show(&site, &alice, "first");
    assert_eq!(pending["state"], "PENDING");
    assert_eq!(pending["node"], site.node.as_str(), "pinned to its node");
    assert_eq!(
        container_running(&container),
        Some(false),
        "a released session waiting for a GPU keeps its container"
    );

    // Bob leaves: Alice's session restarts in the same container, with its file.
    site.devctl_ok(&bob, &["session", "rm", "second"]);
    site.wait_for_state(&alice, "first", "WAITING");
    let back = inspect_container(&container).expect("the same container");
    assert_eq!(
        back["Id"], container_id,
        "the same container, not a new one"
    );
    let (code, marker) = docker_exec(&container, &["cat", "/tmp/ongrid-marker"]);
    assert_eq!(
        (code, marker.trim()),
        (0, "kept-across-the-hold"),
        "{}",
        site.logs()
    );

    // The countdown starts again from the release: held a second time, once.
    let again = site.wait_for_state(&alice, "first", "HELD");
    assert_eq!(holds(&again), 2);
}

#[test]
fn an_idle_session_is_held_and_a_busy_one_in_tmux_is_not() {
    let mut site = Site::start_with_lifecycle(
        &[SimGpu::a100(1), SimGpu::a100(2)],
        "connect_deadline = \"1 hour\"\nstartup_grace = \"1s\"\nidle_timeout = \"8s\"\n\
         max_idle_timeout = \"1 hour\"",
    );
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "quiet", "--wait"]);
    site.devctl_ok(&alice, &["session", "new", "--name", "busy", "--wait"]);

    // Both were used over SSH; in `busy` a "training run" is left behind in tmux.
    ssh_eventually(&site, &alice, "quiet", "true");
    let out = ssh_eventually(
        &site,
        &alice,
        "busy",
        "tmux new-session -d -s train 'while :; do :; done' && tmux has-session -t train",
    );
    assert!(out.status.success(), "{}", explain(&out));
    let started = Instant::now();
    site.wait_for_state(&alice, "quiet", "IDLE");
    site.wait_for_state(&alice, "busy", "IDLE");

    let held = site.wait_for_state(&alice, "quiet", "HELD");
    let reason = held["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("idle: no SSH connection"), "{reason}");

    // Well past its idle timeout, the busy session is still there, kept alive by its CPU use.
    let idle_timeout = Duration::from_secs(8);
    let past = (idle_timeout * 2).saturating_sub(started.elapsed());
    std::thread::sleep(past);
    let busy = show(&site, &alice, "busy");
    assert_eq!(busy["state"], "IDLE", "{busy:#}\n{}", site.logs());
    assert_eq!(busy["lifecycle"]["kept_alive_by"], "cpu", "{busy:#}");
    let shown = site.devctl_ok(&alice, &["session", "show", "busy"]);
    assert!(shown.contains("alive because:  cpu"), "{shown}");

    // A new connection finds the tmux session and its process still running.
    let out = ssh_eventually(
        &site,
        &alice,
        "busy",
        "tmux has-session -t train && echo alive",
    );
    assert_eq!(text(&out.stdout).trim(), "alive", "{}", explain(&out));

    // Stopping the process lets the session go idle too.
    ssh_eventually(&site, &alice, "busy", "tmux kill-server");
    let held = site.wait_for_state(&alice, "busy", "HELD");
    assert!(held["reason"]
        .as_str()
        .unwrap_or_default()
        .starts_with("idle:"));
}

#[test]
fn a_hold_due_while_the_manager_was_down_is_applied_once_when_it_is_back() {
    let deadline = Duration::from_secs(8);
    let mut site = Site::start_with_lifecycle(
        &[SimGpu::a100(1)],
        "connect_deadline = \"8s\"\nstartup_grace = \"1s\"",
    );
    let alice = site.user("Alice");
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let ready = Instant::now();
    site.stop_manager();
    // The countdown passes its deadline while nobody is there to apply it.
    std::thread::sleep((deadline + Duration::from_secs(7)).saturating_sub(ready.elapsed()));
    site.start_manager();
    let held = site.wait_for_state(&alice, "train1", "HELD");
    let reason = held["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("no-connection:"), "{reason}");
    assert!(reason.contains("(due at "), "says it was late: {reason}");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(holds(&show(&site, &alice, "train1")), 1, "applied once");
}

/// Waits for `child` to end within a minute, killing it if it does not.
fn end(mut child: std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn an_open_connection_that_sends_nothing_is_held_and_one_running_a_busy_command_is_not() {
    use std::process::Stdio;
    let idle_timeout = Duration::from_secs(8);
    let mut site = Site::start_with_lifecycle(
        &[SimGpu::a100(1), SimGpu::a100(2)],
        "connect_deadline = \"1 hour\"\nstartup_grace = \"1s\"\nidle_timeout = \"8s\"\n\
         max_idle_timeout = \"1 hour\"",
    );
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "quiet", "--wait"]);
    site.devctl_ok(&alice, &["session", "new", "--name", "busy", "--wait"]);
    ssh_eventually(&site, &alice, "quiet", "true");

    // Two connections stay open: one whose command sleeps (the client sends nothing, as a
    // forgotten terminal), one running a CPU-busy loop for a minute.
    let spawn = |target: &str, command: &str| {
        site.ssh_command(&alice, target)
            .arg(command)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn ssh")
    };
    let quiet = spawn("quiet", "sleep 300");
    let busy = spawn("busy", "timeout 60 sh -c 'while :; do :; done'");
    site.wait_for_state(&alice, "quiet", "CONNECTED");
    site.wait_for_state(&alice, "busy", "CONNECTED");
    let busy_connected = Instant::now();

    // The open connection does not keep `quiet`: `session show` calls it idle, then it is held.
    let shown = site.wait_until(
        "session show to say the connected session is idle",
        Duration::from_secs(30),
        || {
            let out = site.devctl(&alice, &["session", "show", "quiet"]);
            let shown = text(&out.stdout);
            shown.contains("connected but idle since").then_some(shown)
        },
    );
    assert!(shown.contains("state:      CONNECTED"), "{shown}");
    let held = site.wait_for_state(&alice, "quiet", "HELD");
    let reason = held["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("idle: connected but no activity (SSH input, CPU"),
        "{reason}"
    );

    // `busy` is still there well past its idle timeout, kept alive by its CPU use.
    while busy_connected.elapsed() < idle_timeout * 2 {
        let view = show(&site, &alice, "busy");
        assert_eq!(view["state"], "CONNECTED", "{view:#}\n{}", site.logs());
        std::thread::sleep(Duration::from_millis(500));
    }
    let view = show(&site, &alice, "busy");
    assert_eq!(view["state"], "CONNECTED", "{view:#}\n{}", site.logs());
    assert_eq!(view["lifecycle"]["kept_alive_by"], "cpu", "{view:#}");
    end(quiet);
    site.devctl_ok(&alice, &["session", "rm", "busy"]);
    end(busy);
}
