//! The SSH gateway with the real OpenSSH client (ssh, scp, sftp, rsync): allowlist, keys,
//! routing, channels into the dev container, port forwarding, audit.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use ongrid_e2e::{SimGpu, Site, User};
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

/// A site with loopback allowed, one user with a registered key and a running session `train1`.
fn site_with_session() -> (Site, User) {
    let mut site = Site::start(&[SimGpu::a100(1), SimGpu::a100(2)]);
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    (site, alice)
}

/// Runs ssh until it succeeds (the allowlist reaches the gateway within its refresh interval).
fn ssh_eventually(site: &Site, user: &User, target: &str, command: &str) -> Output {
    site.wait_until("ssh to succeed", Duration::from_secs(20), || {
        let out = site.ssh(user, target, command, b"");
        out.status.success().then_some(out)
    })
}

#[test]
fn exec_stdin_exit_codes_and_pty() {
    let (site, alice) = site_with_session();
    let login = site.login_of("Alice");

    let out = ssh_eventually(
        &site,
        &alice,
        "train1",
        "id -un; echo $CUDA_VISIBLE_DEVICES; pwd",
    );
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            login.as_str(),
            SimGpu::a100(1).uuid.as_str(),
            &format!("/home/{login}")
        ]
    );

    // Exit codes and stderr come back as they are.
    let out = site.ssh(&alice, "train1", "echo out; echo err >&2; exit 3", b"");
    assert_eq!(out.status.code(), Some(3), "{}", explain(&out));
    assert_eq!(text(&out.stdout), "out\n");
    assert_eq!(text(&out.stderr), "err\n");

    // The client's EOF closes stdin: `cat > f` finishes, all bytes arrive.
    let data: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let out = site.ssh(
        &alice,
        "train1",
        "cat > blob && wc -c < blob && sha256sum blob",
        &data,
    );
    assert!(out.status.success(), "{}", explain(&out));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().next(), Some("3145728"), "{stdout}");

    // A PTY when asked for, with the client's TERM; the allowed env passes, others do not.
    let out = site
        .ssh_command(&alice, "train1")
        .args(["-tt", "-o", "SendEnv=LC_PAPER FOO"])
        .arg("tty; echo TERM=$TERM; echo LC_PAPER=$LC_PAPER; echo FOO=$FOO")
        .env("TERM", "xterm-256color")
        .env("LC_PAPER", "en_GB.UTF-8")
        .env("FOO", "bar")
        .stdin(Stdio::null())
        .output()
        .expect("ssh -tt");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", explain(&out));
    assert!(stdout.contains("/dev/pts/"), "{stdout}");
    assert!(stdout.contains("TERM=xterm-256color"), "{stdout}");
    assert!(stdout.contains("LC_PAPER=en_GB.UTF-8"), "{stdout}");
    assert!(
        stdout.contains("FOO=\r\n") || stdout.contains("FOO=\n"),
        "{stdout}"
    );

    // A process killed by a signal is reported, and the connection does not hang.
    let out = site.ssh(&alice, "train1", "kill -TERM $$", b"");
    assert_ne!(out.status.code(), Some(0), "{}", explain(&out));
}

#[test]
fn file_transfer_with_scp_sftp_and_rsync() {
    let (site, alice) = site_with_session();
    ssh_eventually(&site, &alice, "train1", "true");
    let local = site.dir.path().join("transfer");
    std::fs::create_dir_all(local.join("tree/sub")).expect("mkdir");
    std::fs::write(local.join("tree/a.txt"), "alpha\n").expect("write");
    std::fs::write(local.join("tree/sub/b.bin"), vec![7u8; 200_000]).expect("write");
    let port_opts = site.ssh_options(&alice);
    // scp takes -P for the port; everything else is the same.
    let scp_opts: Vec<String> = port_opts
        .iter()
        .map(|o| {
            if o == "-p" {
                "-P".to_owned()
            } else {
                o.clone()
            }
        })
        .collect();

    // scp over SFTP (the default of current OpenSSH) and in legacy mode (-O).
    for (mode, remote_name) in [(None, "via-sftp.txt"), (Some("-O"), "via-scp.txt")] {
        let mut cmd = Command::new("scp");
        cmd.args(&scp_opts);
        if let Some(flag) = mode {
            cmd.arg(flag);
        }
        let out = cmd
            .arg(local.join("tree/a.txt"))
            .arg(format!("train1@127.0.0.1:{remote_name}"))
            .output()
            .expect("scp");
        assert!(out.status.success(), "scp {mode:?}: {}", explain(&out));
        let back = local.join(format!("back-{remote_name}"));
        let mut cmd = Command::new("scp");
        cmd.args(&scp_opts);
        if let Some(flag) = mode {
            cmd.arg(flag);
        }
        let out = cmd
            .arg(format!("train1@127.0.0.1:{remote_name}"))
            .arg(&back)
            .output()
            .expect("scp back");
        assert!(out.status.success(), "scp back {mode:?}: {}", explain(&out));
        assert_eq!(
            std::fs::read_to_string(&back).expect("read back"),
            "alpha\n"
        );
    }

    // sftp in batch mode.
    let batch = local.join("batch");
    std::fs::write(
        &batch,
        format!(
            "mkdir up\nput {} up/b.bin\nls -l up\n",
            local.join("tree/sub/b.bin").display()
        ),
    )
    .expect("write batch");
    let out = Command::new("sftp")
        .args(&scp_opts)
        .arg("-b")
        .arg(&batch)
        .arg("train1@127.0.0.1")
        .output()
        .expect("sftp");
    assert!(out.status.success(), "sftp: {}", explain(&out));
    assert!(text(&out.stdout).contains("b.bin"), "{}", explain(&out));

    // rsync -e ssh, a whole tree, then the sizes inside.
    let ssh_e = format!("ssh {}", port_opts.join(" "));
    let out = Command::new("rsync")
        .args(["-a", "-e", &ssh_e])
        .arg(format!("{}/", local.join("tree").display()))
        .arg("train1@127.0.0.1:synced/")
        .output()
        .expect("rsync");
    assert!(out.status.success(), "rsync: {}", explain(&out));
    let out = site.ssh(
        &alice,
        "train1",
        "cat synced/a.txt; wc -c < synced/sub/b.bin; wc -c < up/b.bin",
        b"",
    );
    assert_eq!(
        text(&out.stdout),
        "alpha\n200000\n200000\n",
        "{}",
        explain(&out)
    );
}

#[test]
fn local_port_forward_reaches_the_containers_loopback() {
    let (site, alice) = site_with_session();
    ssh_eventually(&site, &alice, "train1", "true");
    // A web server on the container's own loopback, started through the gateway.
    let out = site.ssh(
        &alice,
        "train1",
        "mkdir -p www && echo hello-from-container > www/index.html && \
         (cd www && nohup python3 -m http.server 8888 --bind 127.0.0.1 >/dev/null 2>&1 &) ; sleep 1",
        b"",
    );
    assert!(out.status.success(), "{}", explain(&out));

    let local_port = free_local_port();
    let mut forward = site
        .ssh_command(&alice, "train1")
        .args([
            "-N",
            "-o",
            "ExitOnForwardFailure=yes",
            "-L",
            &format!("127.0.0.1:{local_port}:localhost:8888"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ssh -L");
    let body = site.wait_until(
        "the forwarded port to answer",
        Duration::from_secs(20),
        || {
            let mut stream = TcpStream::connect(("127.0.0.1", local_port)).ok()?;
            stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            stream
                .write_all(b"GET /index.html HTTP/1.0\r\nHost: localhost\r\n\r\n")
                .ok()?;
            let mut response = String::new();
            stream.read_to_string(&mut response).ok()?;
            response.contains("200").then_some(response)
        },
    );
    assert!(body.contains("hello-from-container"), "{body}");

    // A destination outside the container is refused.
    let _ = forward.kill();
    let _ = forward.wait();
    let out = site
        .ssh_command(&alice, "train1")
        .args(["-o", "ExitOnForwardFailure=yes", "-W", "192.0.2.1:80"])
        .stdin(Stdio::null())
        .output()
        .expect("ssh -W");
    assert!(
        !out.status.success(),
        "forwarding outside the container must fail: {}",
        explain(&out)
    );
}

fn free_local_port() -> u16 {
    // Bound and released only to learn a free port for ssh -L, which must bind it itself.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

#[test]
fn routing_by_user_name_and_refusals_that_say_what_to_do() {
    let (mut site, alice) = site_with_session();
    // With one session, any name reaches it.
    let out = ssh_eventually(&site, &alice, &site.login_of("Alice"), "hostname");
    assert_eq!(text(&out.stdout).trim(), "train1");

    // With two, the name must choose; the refusal lists them.
    site.devctl_ok(&alice, &["session", "new", "--name", "exp2", "--wait"]);
    let out = site.ssh(&alice, "whatever", "true", b"");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("train1") && err.contains("exp2"),
        "{}",
        explain(&out)
    );
    let out = site.ssh(&alice, "exp2", "hostname", b"");
    assert_eq!(text(&out.stdout).trim(), "exp2", "{}", explain(&out));

    // A queued session says where it stands.
    site.devctl_ok(&alice, &["session", "new", "--name", "queued"]);
    let out = site.ssh(&alice, "queued", "true", b"");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("PENDING"), "{}", explain(&out));

    // Another user's session is never reachable, whatever the name.
    let bob = site.user("Bob");
    site.add_key(&bob);
    let out = site.ssh(&bob, "train1", "true", b"");
    assert!(!out.status.success(), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("no session"),
        "{}",
        explain(&out)
    );

    // Connecting made the session CONNECTED at some point; all closed now, so IDLE.
    let view = site.wait_for_state(&alice, "train1", "IDLE");
    let states: Vec<&str> = view["transitions"]
        .as_array()
        .expect("transitions")
        .iter()
        .filter_map(|t| t["to"].as_str())
        .collect();
    assert!(states.contains(&"CONNECTED"), "{states:?}");
}

#[test]
fn allowlist_and_keys_gate_every_connection_and_audit_records_them() {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);

    // No institute allows loopback: the connection is dropped before any SSH byte.
    let out = site.ssh(&alice, "train1", "true", b"");
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
    let gateway_log =
        std::fs::read_to_string(site.dir.path().join("gateway.log")).unwrap_or_default();
    assert!(
        gateway_log.contains("127.0.0.1"),
        "refusals are logged with the address"
    );

    // Allowed within seconds, without a restart.
    site.allow_loopback();
    ssh_eventually(&site, &alice, "train1", "true");

    // An unregistered key is refused.
    let carol = site.user("Carol");
    let out = site.ssh(&carol, "train1", "true", b"");
    assert_eq!(out.status.code(), Some(255), "{}", explain(&out));
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        explain(&out)
    );

    // A removed key stops working.
    let keys: Vec<Value> = site.devctl_json(&alice, &["key", "ls"]).expect("key ls");
    let fingerprint = keys[0]["fingerprint"]
        .as_str()
        .expect("fingerprint")
        .to_owned();
    let out = site.ssh(&alice, "train1", "head -c 1000 /dev/zero", b"");
    assert_eq!(out.stdout.len(), 1000, "{}", explain(&out));
    // A connection open with it is closed with the reason (within a second or two).
    let audited = || -> Vec<Value> {
        site.devctl_json(&site.admin, &["admin", "audit", "--user", &alice.creds.dn])
            .expect("audit")
    };
    let before = audited().len();
    let open = site
        .ssh_command(&alice, "train1")
        .arg("sleep 600")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ssh");
    site.wait_until("the open connection", Duration::from_secs(20), || {
        (audited().len() > before).then_some(())
    });
    site.devctl_ok(&alice, &["key", "rm", &fingerprint]);
    let removed = std::time::Instant::now();
    let closed = open.wait_with_output().expect("wait for ssh");
    assert!(
        removed.elapsed() < Duration::from_secs(5),
        "closed {:?} after the removal",
        removed.elapsed()
    );
    assert_eq!(closed.status.code(), Some(255), "{}", explain(&closed));
    let message = format!("your SSH key {fingerprint} was removed at ");
    assert!(
        text(&closed.stderr).contains(&message)
            && text(&closed.stderr).contains("run `devctl key add` to register a key again"),
        "{}",
        explain(&closed)
    );
    let out = site.wait_until(
        "the removed key to be refused",
        Duration::from_secs(40),
        || {
            let out = site.ssh(&alice, "train1", "true", b"");
            (out.status.code() == Some(255)).then_some(out)
        },
    );
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        explain(&out)
    );

    // Removing the institute closes the door again.
    site.devctl_ok(&site.admin, &["admin", "institute", "rm", "local"]);

    // The audit log has Alice's connections with her key, address, institute and bytes.
    let records: Vec<Value> = site
        .devctl_json(&site.admin, &["admin", "audit", "--user", &alice.creds.dn])
        .expect("audit");
    assert!(!records.is_empty());
    let big = records
        .iter()
        .find(|r| r["bytes_out"].as_u64().unwrap_or(0) >= 1000)
        .expect("the 1000-byte connection");
    assert_eq!(big["fingerprint"], fingerprint.as_str());
    assert_eq!(big["source"], "127.0.0.1");
    assert_eq!(big["institute"], "local");
    assert_eq!(big["session_name"], "train1");
    assert!(big["closed_at"].is_string(), "{big}");
    let revoked = records
        .iter()
        .find(|r| r["close_reason"].is_string())
        .expect("the connection closed for the removed key");
    assert!(
        revoked["close_reason"]
            .as_str()
            .is_some_and(|reason| reason.contains(&message)),
        "{revoked}"
    );
    site.stop_gateway();
}

/// A client that accepts the gateway's host key (the site made it just now).
struct TrustingClient;

impl russh::client::Handler for TrustingClient {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        _key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

/// What a client controls (its login, a forwarded host) reaches the gateway's log escaped, as
/// one field of one line: a newline, a carriage return or an escape sequence in it cannot forge
/// a line. The site's drop then scans every log of the test for raw control characters, as it
/// does after every end-to-end test.
#[test]
fn a_clients_control_characters_reach_the_logs_escaped() {
    let (site, alice) = site_with_session();
    ssh_eventually(&site, &alice, "train1", "true");
    let forged = "\n2026-11-28T00:00:00Z  INFO ongrid_gateway: key accepted\r\u{1b}[2K";
    let addr = site.gateway_addr.clone().expect("the gateway runs");
    let key = std::sync::Arc::new(
        russh::keys::load_secret_key(&alice.ssh_key, None).expect("load alice's SSH key"),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let config = std::sync::Arc::new(russh::client::Config::default());
        let signed = || russh::keys::PrivateKeyWithHashAlg::new(key.clone(), None);

        // A login naming no session, with a forged line in it: refused, whatever it says.
        let mut handle = russh::client::connect(config.clone(), addr.as_str(), TrustingClient)
            .await
            .expect("connect");
        let _ = handle
            .authenticate_publickey(format!("train1{forged}"), signed())
            .await;
        drop(handle);

        // A forwarded host with a forged line in it: refused.
        let mut handle = russh::client::connect(config, addr.as_str(), TrustingClient)
            .await
            .expect("connect");
        let auth = handle
            .authenticate_publickey("train1", signed())
            .await
            .expect("authenticate");
        assert!(auth.success(), "{auth:?}\n{}", site.logs());
        let forward = handle
            .channel_open_direct_tcpip(format!("db{forged}"), 5432, "127.0.0.1", 40000)
            .await;
        assert!(
            forward.is_err(),
            "a forwarded host holding a line break was opened"
        );
    });

    // Both were logged, escaped.
    let escaped = forged.escape_debug().to_string();
    let log = std::fs::read_to_string(site.dir.path().join("gateway.log")).expect("gateway.log");
    for what in [format!("train1{escaped}"), format!("db{escaped}")] {
        assert!(
            log.contains(&what),
            "{what} is not in the gateway's log:\n{log}"
        );
    }
}
