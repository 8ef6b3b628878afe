//! The real gateway (`ongrid_gateway::run` on 127.0.0.1:0) driven by the real OpenSSH client,
//! with an in-test manager and node agent (`harness.rs`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod deadlines;
mod harness;
mod revocations;

use std::time::Duration;

use axum::http::StatusCode;
use harness::{
    banner, eventually, explain, free_port, ip, proxy_balancer, run, text, upper_case_server, Env,
    Options, SshKey,
};
use ongrid_core::api::ConnectionEventKind;
use ongrid_core::stream::StreamKind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_exit_codes_stderr_stdin_eof_and_signals() {
    let env = Env::start(Options::default()).await;

    let out = env.run_ssh(&env.alice, "train1", "exit 3", b"").await;
    assert_eq!(out.status.code(), Some(3), "{}", explain(&out));

    let out = env.run_ssh(&env.alice, "train1", "fail 4 oops", b"").await;
    assert_eq!(out.status.code(), Some(4), "{}", explain(&out));
    assert_eq!(text(&out.stdout), "out\n");
    assert_eq!(text(&out.stderr), "oops\n");

    // The client's EOF reaches the process's stdin: it sees all bytes, then ends.
    let data: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let out = env.run_ssh(&env.alice, "train1", "count", &data).await;
    assert!(out.status.success(), "{}", explain(&out));
    assert_eq!(text(&out.stdout), "3145728\n");

    // Both ways at once, through every layer.
    let out = env.run_ssh(&env.alice, "train1", "cat", &data).await;
    assert!(out.status.success(), "{}", explain(&out));
    assert!(
        out.stdout == data,
        "cat returned {} bytes",
        out.stdout.len()
    );

    // A lot of output, more than every window and queue on the way.
    let out = env.run_ssh(&env.alice, "train1", "big 5000000", b"").await;
    assert!(out.status.success(), "{}", explain(&out));
    assert_eq!(out.stdout.len(), 5_000_000);

    // Death by a signal is an exit-signal: OpenSSH exits 255 without an exit status.
    let out = env.run_ssh(&env.alice, "train1", "kill TERM", b"").await;
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));

    // Every stream carried the session and the authenticated owner.
    let opens = env.agent.opens.lock().unwrap().clone();
    assert_eq!(opens.len(), 6);
    for open in &opens {
        assert_eq!(open.session_id, env.train1.session_id);
        assert_eq!(open.owner.as_str(), harness::ALICE_DN);
        assert!(matches!(open.kind, StreamKind::Exec { pty: None, .. }));
    }

    // A shell without a terminal (as VS Code starts its server) and the sftp subsystem reach
    // the agent as such (its stand-ins echo stdin).
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.arg("-T");
    let out = run(ssh, b"echo from a script\n").await;
    assert!(out.status.success(), "{}", explain(&out));
    assert_eq!(text(&out.stdout), "echo from a script\n");
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args(["-s", "sftp"]);
    let out = run(ssh, b"\x00\x00\x00\x05\x01\x00\x00\x00\x03").await;
    assert!(out.status.success(), "{}", explain(&out));
    let opens = env.agent.opens.lock().unwrap().clone();
    assert_eq!(opens[6].kind, StreamKind::Shell { pty: None });
    assert_eq!(
        opens[7].kind,
        StreamKind::Subsystem {
            name: "sftp".to_owned()
        }
    );
    // Other subsystems are refused, and never reach the agent.
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args(["-s", "netconf"]);
    let out = run(ssh, b"").await;
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
    assert_eq!(env.agent.opens.lock().unwrap().len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_term_window_and_allowed_env() {
    let env = Env::start(Options::default()).await;
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args(["-tt", "-o", "SendEnv=LC_PAPER FOO LANG", "env"])
        .env("TERM", "xterm-256color")
        .env("LC_PAPER", "en_GB.UTF-8")
        .env("LANG", "C.UTF-8")
        .env("FOO", "bar");
    let out = run(ssh, b"").await;
    assert!(out.status.success(), "{}", explain(&out));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("pty=xterm-256color "), "{stdout}");
    assert!(stdout.contains("LC_PAPER=en_GB.UTF-8"), "{stdout}");
    assert!(stdout.contains("LANG=C.UTF-8"), "{stdout}");
    assert!(!stdout.contains("FOO"), "{stdout}");

    let opens = env.agent.opens.lock().unwrap().clone();
    let StreamKind::Exec { pty: Some(pty), .. } = &opens[0].kind else {
        panic!("{:?}", opens[0]);
    };
    assert_eq!(pty.term, "xterm-256color");
    assert!(opens[0].env.iter().all(|(name, _)| name != "FOO"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_refusals_reach_stderr() {
    let env = Env::start(Options::default()).await;
    let out = env
        .run_ssh(
            &env.alice,
            "train1",
            "refuse the container of session train1 is not running: devctl session start train1",
            b"",
        )
        .await;
    assert_ne!(out.status.code(), Some(0), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("is not running: devctl session start train1"),
        "{}",
        explain(&out)
    );

    // An agent nobody listens on: the user is told, the connection does not hang.
    let dead = format!("wss://127.0.0.1:{}", free_port());
    let mut route = env.train1.clone();
    route.agent_url = dead;
    env.manager
        .routes
        .lock()
        .unwrap()
        .insert("train1".to_owned(), Ok(route));
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert_ne!(out.status.code(), Some(0), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("cannot reach node node1 of session train1"),
        "{}",
        explain(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_source_is_closed_before_the_banner_then_allowed_without_restart() {
    let env = Env::start(Options {
        allowlist: vec![("elsewhere", vec!["192.0.2.0/24"])],
        proxy_trusted: None,
        ..Options::default()
    })
    .await;
    // Once the first allowlist arrived, the refusal is about the address.
    eventually("the first allowlist fetch", || async {
        (env.manager
            .allowlist_fetches
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0)
        .then_some(())
    })
    .await;
    assert_eq!(
        banner(env.gateway).await,
        None,
        "no SSH byte for a refused address"
    );
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));

    env.manager.allow(&[("local", &["127.0.0.0/8"])]);
    let out = eventually("the new allowlist to admit loopback", || async {
        let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
        out.status.success().then_some(out)
    })
    .await;
    assert!(out.status.success());
    let events = eventually("the audit events", || async {
        let events = env.manager.events();
        (events.len() >= 2).then_some(events)
    })
    .await;
    assert_eq!(events[0].institute.as_str(), "local");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_refused_keys_are_refused_and_failures_throttled() {
    let env = Env::start(Options::default()).await;
    let carol = SshKey::generate(env.dir.path(), "carol");
    let out = env.run_ssh(&carol, "train1", "exit 0", b"").await;
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        explain(&out)
    );

    // Without BatchMode and at OpenSSH's default log level the manager's reason is shown.
    let interactive = ["BatchMode=no", "LogLevel=INFO"];
    let mut ssh = env.ssh_with(&carol, "train1", env.gateway.port(), &interactive);
    ssh.arg("exit 0");
    let out = run(ssh, b"").await;
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("devctl key add"),
        "the manager's reason reaches the user: {}",
        explain(&out)
    );

    // An expired key: the manager's message says why (answers are cached 1 s at most).
    env.manager.refused_keys.lock().unwrap().insert(
        harness::key_id(&carol.public),
        "key SHA256:x expired at 2026-01-01T00:00Z: renew your proxy and run devctl key add again"
            .to_owned(),
    );
    let out = eventually("the refusal cache to expire", || async {
        let mut ssh = env.ssh_with(&carol, "train1", env.gateway.port(), &interactive);
        ssh.arg("exit 0");
        let out = run(ssh, b"").await;
        text(&out.stderr).contains("expired at").then_some(out)
    })
    .await;
    assert_eq!(out.status.code(), Some(255));

    // Twenty failures a minute from one address, whatever the user names: then even a good key
    // is refused at once. The allowance refills (one attempt every 3 s), so the refused attempt
    // itself is what the test looks at, not a later one.
    let mut throttled = None;
    for n in 0..40 {
        let out = env
            .run_ssh(&carol, &format!("anything{n}"), "exit 0", b"")
            .await;
        assert_eq!(out.status.code(), Some(255));
        if n % 4 != 3 {
            continue;
        }
        let calls_before = env.manager.authorize_calls.lock().unwrap().len();
        let mut ssh = env.ssh_with(&env.alice, "train1", env.gateway.port(), &interactive);
        ssh.arg("exit 0");
        let out = run(ssh, b"").await;
        if !out.status.success() {
            let calls_after = env.manager.authorize_calls.lock().unwrap().len();
            throttled = Some((out, calls_after - calls_before));
            break;
        }
    }
    let (out, manager_calls) = throttled.expect("failures are throttled");
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("too many failed logins from 127.0.0.1"),
        "{}",
        explain(&out)
    );
    assert_eq!(
        manager_calls, 0,
        "a throttled attempt does not reach the manager"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_refusal_is_printed_on_stderr() {
    let env = Env::start(Options::default()).await;
    let message = "session held1 is HELD (its GPU was reclaimed): run devctl session release held1";
    env.manager.routes.lock().unwrap().insert(
        "held1".to_owned(),
        Err((StatusCode::CONFLICT, message.to_owned())),
    );
    let out = env.run_ssh(&env.alice, "held1", "exit 0", b"").await;
    assert_eq!(out.status.code(), Some(1), "{}", explain(&out));
    assert_eq!(text(&out.stderr), format!("{message}\n"));
    assert!(out.stdout.is_empty());

    let out = env.run_ssh(&env.alice, "nosuch", "exit 0", b"").await;
    assert_eq!(out.status.code(), Some(1), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("no session named nosuch"),
        "{}",
        explain(&out)
    );
    assert!(env.agent.opens.lock().unwrap().is_empty());
    // Not routed, so nothing for the audit log.
    assert!(env.manager.events().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_forwarding_through_the_agent() {
    let env = Env::start(Options::default()).await;
    let service = upper_case_server().await;
    let local = free_port();
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args([
        "-N",
        "-o",
        "ExitOnForwardFailure=yes",
        "-L",
        &format!("127.0.0.1:{local}:127.0.0.1:{}", service.port()),
    ])
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped());
    let mut forward = ssh.spawn().unwrap();

    let mut connections = Vec::new();
    for n in 0..3 {
        let mut tcp = eventually("the forwarded port", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", local))
                .await
                .ok()
        })
        .await;
        let line = format!("hello {n}\n");
        tcp.write_all(line.as_bytes()).await.unwrap();
        let mut answer = vec![0u8; line.len()];
        tokio::time::timeout(Duration::from_secs(10), tcp.read_exact(&mut answer))
            .await
            .expect("an answer in time")
            .unwrap();
        assert_eq!(text(&answer), line.to_uppercase());
        connections.push(tcp);
    }
    // The peer's close comes back as EOF.
    let mut tcp = connections.pop().unwrap();
    tcp.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut rest))
        .await
        .expect("EOF in time")
        .unwrap();
    forward.kill().await.unwrap();

    let forwards: Vec<_> = env
        .agent
        .opens
        .lock()
        .unwrap()
        .iter()
        .filter_map(|open| match &open.kind {
            StreamKind::DirectTcpip { host, port } => Some((host.clone(), *port)),
            _ => None,
        })
        .collect();
    assert_eq!(forwards.len(), 3);
    assert!(forwards
        .iter()
        .all(|f| *f == ("127.0.0.1".to_owned(), service.port())));

    // A destination the agent cannot reach fails the channel, with the agent's reason.
    let mut ssh = env.ssh_with(
        &env.alice,
        "train1",
        env.gateway.port(),
        &["BatchMode=yes", "LogLevel=INFO"],
    );
    ssh.args(["-W", &format!("127.0.0.1:{}", free_port())]);
    let out = run(ssh, b"").await;
    assert_ne!(out.status.code(), Some(0), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("in the container failed"),
        "{}",
        explain(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_counts_bytes_and_shutdown_is_graceful() {
    let mut env = Env::start(Options::default()).await;
    let out = env.run_ssh(&env.alice, "train1", "count", b"abc").await;
    assert_eq!(text(&out.stdout), "3\n", "{}", explain(&out));
    let events = eventually("open and close", || async {
        let events = env.manager.events();
        (events.len() == 2).then_some(events)
    })
    .await;
    assert_eq!(events[0].event, ConnectionEventKind::Open);
    assert_eq!(events[1].event, ConnectionEventKind::Close);
    assert_eq!(events[0].connection_id, events[1].connection_id);
    let close = &events[1];
    assert_eq!(close.owner.as_str(), harness::ALICE_DN);
    assert_eq!(close.fingerprint, env.alice.fingerprint());
    assert_eq!(close.source, ip("127.0.0.1"));
    assert_eq!(close.institute.as_str(), "local");
    assert_eq!(close.session_id, env.train1.session_id);
    assert_eq!(close.bytes_in, 3);
    assert_eq!(close.bytes_out, 2);

    // An open connection at shutdown: told to go, its close still reported.
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.arg("cat")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = ssh.spawn().unwrap();
    eventually("the second connection's open", || async {
        (env.manager.events().len() == 3).then_some(())
    })
    .await;
    env.stop().await.expect("run returns Ok");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("ssh ends when the gateway stops")
        .unwrap();
    assert!(!status.success());
    let events = env.manager.events();
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[3].event, ConnectionEventKind::Close);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_protocol_from_a_trusted_balancer() {
    let env = Env::start(Options {
        allowlist: vec![("campus", vec!["10.9.8.0/24"])],
        proxy_trusted: Some(vec!["127.0.0.1/32"]),
        ..Options::default()
    })
    .await;
    let balancer = proxy_balancer(env.gateway, "10.9.8.7:40000".parse().unwrap()).await;
    let out = eventually("the first allowlist", || async {
        let mut ssh = env.ssh(&env.alice, "train1", balancer.port());
        ssh.arg("exit 0");
        let out = run(ssh, b"").await;
        out.status.success().then_some(out)
    })
    .await;
    assert!(out.status.success());
    let events = eventually("the audit events", || async {
        let events = env.manager.events();
        (events.len() == 2).then_some(events)
    })
    .await;
    assert_eq!(
        events[0].source,
        ip("10.9.8.7"),
        "the address from the header"
    );
    assert_eq!(events[0].institute.as_str(), "campus");
    let calls = env.manager.authorize_calls.lock().unwrap().clone();
    assert!(calls.iter().all(|c| c.source == ip("10.9.8.7")));

    // A trusted balancer must send the header: plain SSH from it is refused before the banner.
    let mut tcp = tokio::net::TcpStream::connect(env.gateway).await.unwrap();
    tcp.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await.unwrap();
    let mut buffer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut buffer))
        .await
        .expect("closed in time")
        .unwrap_or_default();
    assert!(buffer.is_empty(), "{}", text(&buffer));

    // A client address the allowlist does not know is refused even through the balancer.
    let stranger = proxy_balancer(env.gateway, "203.0.113.5:1234".parse().unwrap()).await;
    assert_eq!(banner(stranger).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_header_from_an_untrusted_peer_is_refused() {
    let env = Env::start(Options {
        allowlist: vec![("local", vec!["127.0.0.0/8"])],
        proxy_trusted: Some(vec!["192.0.2.10/32"]),
        ..Options::default()
    })
    .await;
    // Loopback is no balancer here: plain SSH works...
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert!(out.status.success(), "{}", explain(&out));
    // ...and a PROXY header claiming another source ends the connection.
    let mut tcp = tokio::net::TcpStream::connect(env.gateway).await.unwrap();
    let header =
        ongrid_gateway::proxy_protocol::encode(&ongrid_gateway::proxy_protocol::Header::Proxy {
            source: "10.1.1.1:1000".parse().unwrap(),
            destination: env.gateway,
        });
    tcp.write_all(&header).await.unwrap();
    tcp.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await.unwrap();
    let mut buffer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut buffer))
        .await
        .expect("closed in time")
        .unwrap_or_default();
    let received = text(&buffer);
    assert!(
        received.starts_with("SSH-2.0-ongrid_gateway_"),
        "{received}"
    );
    assert_eq!(
        received.lines().count(),
        1,
        "nothing after the version: {received:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_never_wedges_the_connection() {
    let env = Env::start(Options::default()).await;
    // All of stdin is sent before any output is read: the process (cat) blocks on its output
    // while the client keeps sending, and the window the client grants only moves once its
    // reader starts. The gateway must take the input ahead instead of deadlocking.
    let spawn_cat = || {
        let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
        ssh.arg("cat")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        ssh.spawn().unwrap()
    };
    let data: Vec<u8> = (0..24 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let mut child = spawn_cat();
    let mut stdin = child.stdin.take().unwrap();
    tokio::time::timeout(Duration::from_secs(30), stdin.write_all(&data))
        .await
        .expect("the client could send all its input without anyone reading")
        .unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("then everything comes back")
        .unwrap();
    assert!(out.status.success(), "{}", explain(&out));
    assert!(out.stdout == data, "{} bytes back", out.stdout.len());

    // Far more than the gateway holds for one channel: that channel is closed with a reason,
    // the connection and the gateway carry on.
    let data = vec![7u8; 96 * 1024 * 1024];
    let mut child = spawn_cat();
    let mut stdin = child.stdin.take().unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(60), stdin.write_all(&data))
        .await
        .expect("the channel is closed instead of wedged");
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("ssh ends")
        .unwrap();
    assert!(
        text(&out.stderr).contains("closing this channel"),
        "{}",
        explain(&out)
    );
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert!(out.status.success(), "{}", explain(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_forward_does_not_hold_up_the_other_channels() {
    let env = Env::start(Options::default()).await;
    let (firehose, written) = harness::firehose_server().await;
    let echo = upper_case_server().await;
    let (stalled_port, echo_port) = (free_port(), free_port());
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.args([
        "-N",
        "-o",
        "ExitOnForwardFailure=yes",
        "-L",
        &format!("127.0.0.1:{stalled_port}:127.0.0.1:{}", firehose.port()),
        "-L",
        &format!("127.0.0.1:{echo_port}:127.0.0.1:{}", echo.port()),
    ])
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    let mut forward = ssh.spawn().unwrap();

    // A forwarded connection whose local end never reads: the firehose fills every buffer on
    // the way until it can write no more.
    let _stalled = eventually("the forwarded firehose", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", stalled_port))
            .await
            .ok()
    })
    .await;
    eventually("the firehose to be held back", || async {
        let before = written.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let after = written.load(std::sync::atomic::Ordering::SeqCst);
        (before > 0 && before == after).then_some(())
    })
    .await;
    let held_back = written.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        held_back < 256 * 1024 * 1024,
        "backpressure, not buffering: {held_back} bytes written"
    );

    // Meanwhile another channel of the same connection works.
    for n in 0..3 {
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", echo_port))
            .await
            .unwrap();
        let line = format!("still alive {n}\n");
        tcp.write_all(line.as_bytes()).await.unwrap();
        let mut answer = vec![0u8; line.len()];
        tokio::time::timeout(Duration::from_secs(10), tcp.read_exact(&mut answer))
            .await
            .expect("the other channel answers while one is stalled")
            .unwrap();
        assert_eq!(text(&answer), line.to_uppercase());
    }
    forward.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_requests_that_want_no_reply_get_none() {
    let env = Env::start(Options::default()).await;
    // OpenSSH sends `env` with want-reply false. A variable the gateway refuses (BASH_ENV is
    // never passed on) must not send a failure that OpenSSH takes for the answer to the exec
    // request after it ("exec request failed"). Several rounds: the wrong pairing was a race.
    for with_pty in [false, true, false, true, false, true] {
        let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
        if with_pty {
            ssh.arg("-tt");
        }
        ssh.args(["-o", "SendEnv=BASH_ENV LANG LC_ALL", "env"])
            .env("BASH_ENV", "/tmp/evil.sh")
            .env("LANG", "C.UTF-8")
            .env("LC_ALL", "C.UTF-8");
        let out = run(ssh, b"").await;
        assert!(out.status.success(), "{}", explain(&out));
        let stdout = text(&out.stdout);
        assert!(stdout.contains("LANG=C.UTF-8"), "{}", explain(&out));
        assert!(stdout.contains("LC_ALL=C.UTF-8"), "{}", explain(&out));
        assert!(!stdout.contains("BASH_ENV"), "{}", explain(&out));
        assert_eq!(stdout.contains("pty=none"), !with_pty, "{}", explain(&out));
    }

    // The same for a connection whose routing is refused: the manager's message, exit 1.
    let message = "session held1 is HELD (its GPU was reclaimed): run devctl session release held1";
    env.manager.routes.lock().unwrap().insert(
        "held1".to_owned(),
        Err((StatusCode::CONFLICT, message.to_owned())),
    );
    let mut ssh = env.ssh(&env.alice, "held1", env.gateway.port());
    ssh.args(["-o", "SendEnv=BASH_ENV", "env"])
        .env("BASH_ENV", "/tmp/evil.sh");
    let out = run(ssh, b"").await;
    assert_eq!(out.status.code(), Some(1), "{}", explain(&out));
    assert_eq!(
        text(&out.stderr),
        format!("{message}\n"),
        "{}",
        explain(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_from_other_addresses_never_lock_a_user_out() {
    let env = Env::start(Options {
        allowlist: vec![("campus", vec!["10.9.8.0/24"])],
        proxy_trusted: Some(vec!["127.0.0.1/32"]),
        ..Options::default()
    })
    .await;
    let carol = SshKey::generate(env.dir.path(), "carol");
    let via = |source: &'static str| proxy_balancer(env.gateway, source.parse().unwrap());
    let owner = via("10.9.8.100:40000").await;
    eventually("the first allowlist", || async {
        let mut ssh = env.ssh(&env.alice, "train1", owner.port());
        ssh.arg("exit 0");
        run(ssh, b"").await.status.success().then_some(())
    })
    .await;

    // Failed logins under train1's name from three other addresses, more than any one user
    // name's allowance at one address.
    let attackers = [
        via("10.9.8.1:1000").await,
        via("10.9.8.2:1000").await,
        via("10.9.8.3:1000").await,
    ];
    let attempts = attackers.iter().map(|balancer| {
        let (carol, env) = (&carol, &env);
        async move {
            for _ in 0..6 {
                let mut ssh = env.ssh(carol, "train1", balancer.port());
                ssh.arg("exit 0");
                let out = run(ssh, b"").await;
                assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
            }
        }
    });
    futures::future::join_all(attempts).await;

    // The owner, from their own address, logs in at once.
    let mut ssh = env.ssh(&env.alice, "train1", owner.port());
    ssh.arg("exit 0");
    let out = run(ssh, b"").await;
    assert!(out.status.success(), "{}", explain(&out));

    // From one address, a user name that keeps failing is refused there, while other names
    // from that address still get through to the manager.
    let noisy = via("10.9.8.4:1000").await;
    let mut refused = None;
    for _ in 0..15 {
        let mut ssh = env.ssh(&carol, "train1", noisy.port());
        ssh.arg("exit 0");
        run(ssh, b"").await;
        let mut ssh = env.ssh_with(
            &env.alice,
            "train1",
            noisy.port(),
            &["BatchMode=no", "LogLevel=INFO"],
        );
        ssh.arg("exit 0");
        let out = run(ssh, b"").await;
        if !out.status.success() {
            refused = Some(out);
            break;
        }
    }
    let out = refused.expect("a user name failing at one address is throttled there");
    assert!(
        text(&out.stderr).contains("too many failed logins for user \"train1\" from 10.9.8.4"),
        "{}",
        explain(&out)
    );
    // Another name from the same address: authenticated, then told there is no such session.
    let mut ssh = env.ssh(&env.alice, "nosuch", noisy.port());
    ssh.arg("exit 0");
    let out = run(ssh, b"").await;
    assert_eq!(out.status.code(), Some(1), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("no session named nosuch"),
        "{}",
        explain(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_key_is_refused_within_a_second() {
    let env = Env::start(Options::default()).await;
    let calls = || env.manager.authorize_calls.lock().unwrap().len();
    let before = calls();
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert!(out.status.success(), "{}", explain(&out));
    assert_eq!(
        calls() - before,
        1,
        "the key offer and the signed login share one question to the manager"
    );

    env.manager
        .keys
        .lock()
        .unwrap()
        .remove(&harness::key_id(&env.alice.public));
    let removed = tokio::time::Instant::now();
    // Log in again and again until refused: no attempt that starts a second or more after the
    // removal may succeed, and the refusal comes within a few.
    loop {
        let started = tokio::time::Instant::now();
        let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
        if !out.status.success() {
            assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
            break;
        }
        assert!(
            started - removed < Duration::from_secs(1),
            "a login {:?} after the key's removal succeeded",
            started - removed
        );
        assert!(removed.elapsed() < Duration::from_secs(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_not_logged_in_are_capped_per_source() {
    let env = Env::start(Options {
        extra_config: "per_source_max_startups = 2\n",
        ..Options::default()
    })
    .await;
    // A logged-in connection does not count.
    let mut shell = env.ssh(&env.alice, "train1", env.gateway.port());
    shell
        .arg("cat")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut shell = shell.spawn().unwrap();
    eventually("the shell's connection", || async {
        (!env.manager.events().is_empty()).then_some(())
    })
    .await;

    // Two connections that never log in take this address's share...
    let mut idle = Vec::new();
    for _ in 0..2 {
        let mut tcp = tokio::net::TcpStream::connect(env.gateway).await.unwrap();
        let mut buffer = vec![0u8; 8];
        tokio::time::timeout(Duration::from_secs(10), tcp.read_exact(&mut buffer))
            .await
            .expect("the banner in time")
            .unwrap();
        assert_eq!(&buffer, b"SSH-2.0-");
        idle.push(tcp);
    }
    // ...so the next one is closed before the banner, even a user's.
    assert_eq!(banner(env.gateway).await, None);
    let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));

    // One of them goes away: its slot is free again.
    drop(idle.pop());
    eventually("a free slot", || async {
        let out = env.run_ssh(&env.alice, "train1", "exit 0", b"").await;
        out.status.success().then_some(())
    })
    .await;
    drop(shell.stdin.take());
    let status = tokio::time::timeout(Duration::from_secs(10), shell.wait())
        .await
        .expect("the shell ends")
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssh_the_test_drops_is_killed() {
    // Every ssh of these tests is spawned through `Env::ssh`, which kills it when dropped, so
    // a failing test leaves no client behind.
    let env = Env::start(Options::default()).await;
    let mut ssh = env.ssh(&env.alice, "train1", env.gateway.port());
    ssh.arg("cat")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let child = ssh.spawn().unwrap();
    let pid = child.id().expect("running");
    eventually("the connection's open", || async {
        (env.manager.events().len() == 1).then_some(())
    })
    .await;
    drop(child);
    // Gone (or a zombie waiting for tokio to reap it), and its connection closed.
    eventually("ssh to be killed", || async {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        matches!(state, None | Some("Z")).then_some(())
    })
    .await;
    let events = eventually("the close", || async {
        let events = env.manager.events();
        (events.len() == 2).then_some(events)
    })
    .await;
    assert_eq!(events[1].event, ConnectionEventKind::Close);
}
