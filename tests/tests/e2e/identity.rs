//! Grid identities end to end: real grid certificates and `grid-proxy-init` proxies (made by
//! `x509/scripts/gridca.sh`), devctl finding them as grid tools do (`X509_USER_PROXY`,
//! `/tmp/x509up_u<uid>`), its one-line errors, and an SSH key that expires with the proxy it was
//! registered with, refused by the gateway with the renewal message on ssh's stderr.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use ongrid_e2e::{GridCa, SimGpu, Site, User};
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

/// The one line devctl printed on stderr for a failure (exit code 1).
fn one_line_error(out: &Output) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", explain(out));
    assert_eq!(stderr.lines().count(), 1, "not one line: {}", explain(out));
    stderr.trim_end().to_owned()
}

/// devctl as `user` with `proxy` in `X509_USER_PROXY`.
fn devctl_with_proxy(site: &Site, user: &User, proxy: &Path, args: &[&str]) -> Output {
    site.devctl_env(user, &[("X509_USER_PROXY", proxy)], args)
}

fn devctl_json(site: &Site, user: &User, proxy: &Path, args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = devctl_with_proxy(site, user, proxy, &args);
    assert!(out.status.success(), "{}\n{}", explain(&out), site.logs());
    serde_json::from_slice(&out.stdout).expect("devctl --json prints JSON")
}

/// This process's real uid, as `id -u` prints it.
fn current_uid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
        .expect("a Uid: line in /proc/self/status")
}

/// `/tmp/x509up_u<uid>` of this process's user, created for the test and removed on drop.
struct DefaultProxy {
    path: PathBuf,
}

impl DefaultProxy {
    fn install(from: &Path) -> Self {
        let path = PathBuf::from(format!("/tmp/x509up_u{}", current_uid()));
        assert!(
            !path.exists(),
            "{} exists on this machine and would be overwritten: move it away to run this test",
            path.display()
        );
        std::fs::copy(from, &path).expect("copy the proxy to /tmp/x509up_u<uid>");
        Self { path }
    }
}

impl Drop for DefaultProxy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[test]
fn devctl_finds_proxies_and_explains_refusals_in_one_line() {
    let mut site = Site::start_grid(&[SimGpu::a100(1)]);
    let carol = site.grid_user("Carol");
    let login = site.login_of("Carol");
    let grid = site.grid();
    let dir = site.dir.path().to_path_buf();

    // X509_USER_PROXY: whoami shows the proxy, as text and as JSON.
    let proxy = grid
        .proxy(&login, &dir.join("carol.pem"), &["-valid", "2:00"])
        .unwrap();
    let out = devctl_with_proxy(&site, &carol, &proxy, &["whoami"]);
    assert!(out.status.success(), "{}", explain(&out));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!("dn:          {}\n", carol.creds.dn)),
        "{stdout}"
    );
    assert!(
        stdout.contains("credential:  impersonation proxy\n"),
        "{stdout}"
    );
    assert!(stdout.contains("time left:   1h 5"), "{stdout}");
    let me = devctl_json(&site, &carol, &proxy, &["whoami"]);
    assert_eq!(me["dn"], carol.creds.dn.as_str());
    assert_eq!(me["user_name"], login.as_str());
    assert_eq!(me["credential"], "impersonation");

    // /tmp/x509up_u<uid> when nothing else names a credential.
    {
        let _default = DefaultProxy::install(&proxy);
        let out = site.devctl_env(&carol, &[], &["whoami", "--json"]);
        assert!(out.status.success(), "{}", explain(&out));
        let me: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(me["dn"], carol.creds.dn.as_str());
    }
    let uid = current_uid();
    let line = one_line_error(&site.devctl_env(&carol, &[], &["whoami"]));
    assert!(
        line.contains(&format!("/tmp/x509up_u{uid} does not exist")),
        "{line}"
    );
    assert!(line.contains("run voms-proxy-init"), "{line}");

    // A legacy proxy is refused before any connection, naming -rfc.
    let legacy = grid
        .proxy(&login, &dir.join("carol-legacy.pem"), &["-old"])
        .unwrap();
    let line = one_line_error(&devctl_with_proxy(&site, &carol, &legacy, &["whoami"]));
    assert!(line.contains("-rfc"), "{line}");

    // A proxy from a CA the manager does not trust: the issuer and where CAs are looked up.
    let stranger = GridCa::create(&dir.join("stranger"), Some("Stranger CA")).unwrap();
    stranger.user("mallory").unwrap();
    let foreign = stranger
        .proxy("mallory", &dir.join("mallory.pem"), &[])
        .unwrap();
    let line = one_line_error(&devctl_with_proxy(&site, &carol, &foreign, &["whoami"]));
    assert!(
        line.contains("(issuer /DC=org/DC=ongrid-test/CN=Stranger CA)"),
        "{line}"
    );
    assert!(line.contains("ca_dir"), "{line}");

    // A limited proxy reads but cannot register a key.
    let limited = grid
        .proxy(&login, &dir.join("carol-limited.pem"), &["-limited"])
        .unwrap();
    let me = devctl_json(&site, &carol, &limited, &["whoami"]);
    assert_eq!(me["credential"], "limited");
    let public = format!("{}.pub", carol.ssh_key.display());
    let out = devctl_with_proxy(&site, &carol, &limited, &["key", "add", &public]);
    assert_eq!(out.status.code(), Some(1), "{}", explain(&out));
    // A note names the key file first; the error is one line.
    let stderr = text(&out.stderr);
    let line = stderr.lines().last().unwrap_or_default();
    assert!(
        line.starts_with("error: a limited proxy cannot register SSH keys: make a full proxy"),
        "{stderr}"
    );
}

#[test]
fn a_key_expires_with_its_proxy_and_ssh_says_how_to_renew() {
    let mut site = Site::start_grid(&[SimGpu::a100(1)]);
    site.allow_loopback();
    let dave = site.grid_user("Dave");
    let login = site.login_of("Dave");
    let grid = site.grid();
    let dir = site.dir.path().to_path_buf();
    let long = grid
        .proxy(&login, &dir.join("dave.pem"), &["-valid", "2:00"])
        .unwrap();
    let out = devctl_with_proxy(
        &site,
        &dave,
        &long,
        &["session", "new", "--name", "train1", "--wait"],
    );
    assert!(out.status.success(), "{}\n{}", explain(&out), site.logs());

    // The key is registered with a proxy valid for one minute, and expires with it.
    let short = grid
        .proxy(&login, &dir.join("dave-short.pem"), &["-valid", "0:1"])
        .unwrap();
    let me = devctl_json(&site, &dave, &short, &["whoami"]);
    let public = format!("{}.pub", dave.ssh_key.display());
    let key = devctl_json(&site, &dave, &short, &["key", "add", &public]);
    assert_eq!(key["expires_at"], me["not_after"], "{key}");
    let expires_at: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(key["expires_at"].clone()).unwrap();
    assert!(expires_at <= chrono::Utc::now() + chrono::TimeDelta::seconds(61));

    let out = site.wait_until("ssh with the new key", Duration::from_secs(20), || {
        let out = site.ssh(&dave, "train1", "id -un", b"");
        out.status.success().then_some(out)
    });
    assert_eq!(text(&out.stdout).trim(), login);

    // After the proxy's end, the gateway refuses the key; at OpenSSH's default log level
    // (without BatchMode) ssh prints the manager's reason.
    let interactive_ssh = || {
        let mut ssh = std::process::Command::new("ssh");
        let options = site.ssh_options(&dave);
        // OpenSSH keeps the first value of an option: these win over the harness's.
        ssh.args(["-o", "BatchMode=no", "-o", "LogLevel=INFO"])
            .args(options)
            .arg("train1@127.0.0.1")
            .arg("id -un")
            .stdin(std::process::Stdio::null());
        ssh.output().expect("run ssh")
    };
    let out = site.wait_until(
        "the key to expire with the proxy",
        Duration::from_secs(120),
        || {
            let out = interactive_ssh();
            (!out.status.success()).then_some(out)
        },
    );
    assert!(
        chrono::Utc::now() >= expires_at,
        "refused before the proxy expired: {}",
        explain(&out)
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("expired at"), "{}", explain(&out));
    assert!(stderr.contains("voms-proxy-init"), "{}", explain(&out));
    assert!(stderr.contains("devctl key add"), "{}", explain(&out));

    // (devctl itself still accepts the proxy for the five minutes of tolerated clock skew, as the
    // manager does; its own expiry message is tested in devctl's unit tests.)

    // Renewing: `devctl key add` with a fresh proxy makes the key work again.
    devctl_json(&site, &dave, &long, &["key", "add", &public]);
    let out = site.wait_until("ssh after renewing", Duration::from_secs(20), || {
        let out = site.ssh(&dave, "train1", "id -un", b"");
        out.status.success().then_some(out)
    });
    assert_eq!(text(&out.stdout).trim(), login);
}
