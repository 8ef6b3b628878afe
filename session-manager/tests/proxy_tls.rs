//! The manager's TLS with grid proxies, checked with the tools grid users have: the CA, users,
//! VOMS server and proxies come from `x509/scripts/gridca.sh` (openssl, grid-proxy-init,
//! voms-proxy-fake), and curl presents them over TLS 1.2 and TLS 1.3 (OpenSSL sends the whole
//! chain from a proxy file). The manager runs in-process on 127.0.0.1:0 with a real SQLite file.

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use ongrid_core::api::{CredentialKind, KeyView, WhoAmI};
use ongrid_manager::Config;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const VO: &str = "myvo";
const VOMS_HOST: &str = "voms.example.org";
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIs0Rx6fnjvHHuZiVBU9tDldTJLHwhaBajt5VxhThYaf a@laptop";
const NODE_TOKEN: &str = "node1-0123456789abcdef0123456789abcdef";

fn gridca_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../x509/scripts/gridca.sh")
}

/// Runs `gridca.sh ARGS`, failing the test with its output when it fails.
fn gridca(args: &[&str]) {
    run_script(&gridca_script(), args);
}

fn run_script(script: &Path, args: &[&str]) {
    let out = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .output()
        .expect("run x509/scripts/gridca.sh (needs openssl, grid-proxy-init, voms-proxy-fake)");
    assert!(
        out.status.success(),
        "gridca.sh {} failed:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn text(path: &Path) -> String {
    path.display().to_string()
}

/// A site on disk: a grid CA with users alice and bob, a VOMS server for `myvo`, the manager's
/// host certificate, and a second CA the manager does not trust.
struct Site {
    dir: tempfile::TempDir,
    grid: PathBuf,
    config: Config,
}

impl Site {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let grid = dir.path().join("grid");
        let grid_s = text(&grid);
        gridca(&["ca", &grid_s]);
        gridca(&["host", &grid_s, "localhost"]);
        gridca(&["user", &grid_s, "alice"]);
        gridca(&["user", &grid_s, "bob"]);
        gridca(&["voms", &grid_s, VO, VOMS_HOST]);
        let stranger = dir.path().join("stranger");
        let stranger_s = text(&stranger);
        // Another CA, /DC=org/DC=ongrid-test/CN=Stranger CA, which the manager does not trust.
        gridca(&["ca", &stranger_s, "Stranger CA"]);
        gridca(&["user", &stranger_s, "mallory"]);
        let mallory = text(&dir.path().join("mallory.pem"));
        gridca(&["proxy", &stranger_s, "mallory", &mallory]);

        std::fs::write(
            dir.path().join("agent-tokens"),
            format!("node1 {NODE_TOKEN}\n"),
        )
        .unwrap();
        let host = grid.join("hosts/localhost");
        let config_path = dir.path().join("manager.toml");
        let toml = format!(
            r#"
listen = "127.0.0.1:0"
database = "{db}"
tls_cert = "{cert}"
tls_key = "{key}"
ca_dir = "{ca_dir}"
vomsdir = "{vomsdir}"
admins = ["/{VO}/Role=admin"]
agent_tokens_file = "{tokens}"
"#,
            db = text(&dir.path().join("manager.db")),
            cert = text(&host.join("hostcert.pem")),
            key = text(&host.join("hostkey.pem")),
            ca_dir = text(&grid.join("certificates")),
            vomsdir = text(&grid.join("vomsdir")),
            tokens = text(&dir.path().join("agent-tokens")),
        );
        std::fs::write(&config_path, &toml).unwrap();
        let config = Config::from_toml(&toml, &config_path, |_| None).unwrap();
        Self { dir, grid, config }
    }

    /// `grid-proxy-init -rfc` of `user` into a new file, with extra flags.
    fn proxy(&self, user: &str, file: &str, flags: &[&str]) -> PathBuf {
        let out = self.dir.path().join(file);
        let mut args = vec![
            "proxy",
            self.grid.to_str().unwrap(),
            user,
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        gridca(&args);
        out
    }

    /// A proxy of `user` with a VOMS attribute certificate of `myvo` carrying `fqans`.
    fn voms_proxy(&self, user: &str, file: &str, fqans: &[&str]) -> PathBuf {
        let out = self.dir.path().join(file);
        let mut args = vec![
            "vomsproxy",
            self.grid.to_str().unwrap(),
            user,
            VO,
            VOMS_HOST,
            out.to_str().unwrap(),
        ];
        for fqan in fqans {
            args.extend_from_slice(&["-fqan", fqan]);
        }
        gridca(&args);
        out
    }

    fn ca_dir(&self) -> PathBuf {
        self.grid.join("certificates")
    }

    async fn start(&self) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ongrid_manager::run(
            self.config.clone(),
            listener,
            shutdown.clone(),
        ));
        Running {
            addr,
            shutdown,
            task,
            ca_dir: self.ca_dir(),
        }
    }
}

struct Running {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
    ca_dir: PathBuf,
}

/// Which TLS version curl must use.
#[derive(Debug, Clone, Copy)]
enum Tls {
    V12,
    V13,
}

impl Running {
    /// `curl` presenting `cert` (and its key, the same file for a proxy) to `path`, with a JSON
    /// body for POST. Returns curl's output; `-w` appends the HTTP status on a last line.
    async fn curl(
        &self,
        tls: Tls,
        cert: &Path,
        key: &Path,
        path: &str,
        body: Option<&str>,
    ) -> Output {
        let mut command = tokio::process::Command::new("curl");
        command
            .args(["-sS", "--max-time", "20", "-w", "\n%{http_code}"])
            .arg("--cert")
            .arg(cert)
            .arg("--key")
            .arg(key)
            .arg("--capath")
            .arg(&self.ca_dir);
        match tls {
            Tls::V12 => command.args(["--tlsv1.2", "--tls-max", "1.2"]),
            Tls::V13 => command.args(["--tlsv1.3"]),
        };
        if let Some(body) = body {
            command.args(["-H", "content-type: application/json", "--data", body]);
        }
        command
            .arg(format!("https://127.0.0.1:{}{path}", self.addr.port()))
            .output()
            .await
            .expect("run curl")
    }

    /// Like [`Self::curl`], requiring success; returns the HTTP status and body.
    async fn call(&self, tls: Tls, cert: &Path, path: &str, body: Option<&str>) -> (u16, String) {
        let out = self.curl(tls, cert, cert, path, body).await;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "curl {path} with {} over {tls:?} failed: {}\n{stdout}",
            cert.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let (body, status) = stdout.rsplit_once('\n').unwrap();
        (status.parse().unwrap(), body.to_owned())
    }

    async fn whoami(&self, tls: Tls, cert: &Path) -> WhoAmI {
        let (status, body) = self.call(tls, cert, "/v1/whoami", None).await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the manager stops within 20 s")
            .unwrap()
            .unwrap();
    }
}

/// The earliest notAfter of the certificates in a PEM file, as `openssl x509` reads them.
fn earliest_not_after(pem_file: &Path) -> DateTime<Utc> {
    let pem = std::fs::read_to_string(pem_file).unwrap();
    let mut earliest: Option<DateTime<Utc>> = None;
    for block in pem.split_inclusive("-----END CERTIFICATE-----\n") {
        let Some(start) = block.find("-----BEGIN CERTIFICATE-----") else {
            continue;
        };
        let mut child = std::process::Command::new("openssl")
            .args(["x509", "-noout", "-enddate", "-dateopt", "iso_8601"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(&block.as_bytes()[start..])
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let line = String::from_utf8(out.stdout).unwrap();
        let value = line.trim().strip_prefix("notAfter=").unwrap();
        let at = NaiveDateTime::parse_from_str(value, "%Y-%m-%d %H:%M:%SZ")
            .unwrap()
            .and_utc();
        earliest = Some(earliest.map_or(at, |e| e.min(at)));
    }
    earliest.unwrap()
}

#[tokio::test]
async fn proxies_authenticate_over_tls_12_and_13() {
    let site = Site::new();
    let m = site.start().await;
    let alice_dn = "/DC=org/DC=ongrid-test/OU=People/CN=alice";
    let proxy = site.proxy("alice", "alice.pem", &["-valid", "2:00"]);
    // A proxy of a proxy: the chain has three certificates before the CA.
    let second = site.proxy(
        proxy.to_str().unwrap(),
        "alice-2nd.pem",
        &["-valid", "1:00"],
    );
    for tls in [Tls::V12, Tls::V13] {
        let me = m.whoami(tls, &proxy).await;
        assert_eq!(me.dn.as_str(), alice_dn, "{tls:?}");
        assert_eq!(me.user_name.as_str(), "alice");
        assert!(!me.admin);
        assert_eq!(me.credential, Some(CredentialKind::Impersonation));
        assert!(me.fqans.is_empty() && me.vos.is_empty(), "{me:?}");
        assert_eq!(me.not_after, Some(earliest_not_after(&proxy)));

        let me = m.whoami(tls, &second).await;
        assert_eq!(me.dn.as_str(), alice_dn);
        assert_eq!(me.credential, Some(CredentialKind::Impersonation));
        assert_eq!(me.not_after, Some(earliest_not_after(&second)));
    }

    // The plain user certificate still works, as the end-entity it is.
    let user = site.grid.join("users/alice");
    let out = m
        .curl(
            Tls::V13,
            &user.join("usercert.pem"),
            &user.join("userkey.pem"),
            "/v1/whoami",
            None,
        )
        .await;
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let me: WhoAmI = serde_json::from_str(stdout.rsplit_once('\n').unwrap().0).unwrap();
    assert_eq!(me.dn.as_str(), alice_dn);
    assert_eq!(me.credential, Some(CredentialKind::EndEntity));
    m.stop().await;
}

#[tokio::test]
async fn voms_attributes_are_read_and_fqans_can_make_admins() {
    let site = Site::new();
    let m = site.start().await;
    let member = site.voms_proxy("alice", "alice-voms.pem", &["/myvo/prod"]);
    let admin = site.voms_proxy("bob", "bob-voms.pem", &["/myvo/Role=admin"]);
    for tls in [Tls::V12, Tls::V13] {
        let me = m.whoami(tls, &member).await;
        assert_eq!(me.vos, [VO]);
        assert_eq!(me.fqans, ["/myvo/prod"]);
        assert!(!me.admin);

        let me = m.whoami(tls, &admin).await;
        assert_eq!(me.dn.as_str(), "/DC=org/DC=ongrid-test/OU=People/CN=bob");
        assert_eq!(me.fqans, ["/myvo/Role=admin"]);
        assert!(me.admin, "/myvo/Role=admin is in the config's admins");
    }
    // Admin rights come with the FQAN, not with the DN: Bob's plain proxy is no admin.
    let plain = site.proxy("bob", "bob.pem", &[]);
    assert!(!m.whoami(Tls::V13, &plain).await.admin);
    // An admin-only route agrees.
    let (status, _) = m.call(Tls::V13, &admin, "/v1/keys?all=true", None).await;
    assert_eq!(status, 200);
    let (status, body) = m.call(Tls::V13, &plain, "/v1/keys?all=true", None).await;
    assert_eq!(status, 403, "{body}");
    m.stop().await;
}

#[tokio::test]
async fn limited_proxies_read_but_cannot_register_keys() {
    let site = Site::new();
    let m = site.start().await;
    let limited = site.proxy("alice", "alice-limited.pem", &["-limited"]);
    let full = site.proxy("alice", "alice.pem", &[]);
    let body = serde_json::json!({ "public_key": KEY }).to_string();
    for tls in [Tls::V12, Tls::V13] {
        let me = m.whoami(tls, &limited).await;
        assert_eq!(me.credential, Some(CredentialKind::Limited));
        let (status, body_text) = m.call(tls, &limited, "/v1/keys", None).await;
        assert_eq!(status, 200, "{body_text}");
        let (status, answer) = m.call(tls, &limited, "/v1/keys", Some(&body)).await;
        assert_eq!(status, 403, "{answer}");
        let error: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("make a full proxy"), "{message}");
    }
    // A full proxy registers the key, which then expires with that proxy.
    let (status, answer) = m.call(Tls::V13, &full, "/v1/keys", Some(&body)).await;
    assert_eq!(status, 201, "{answer}");
    let key: KeyView = serde_json::from_str(&answer).unwrap();
    assert_eq!(key.expires_at, earliest_not_after(&full));
    m.stop().await;

    // The site may allow limited proxies to register keys.
    let mut config = site.config.clone();
    config.limited_proxies_may_register_keys = true;
    let site = Site { config, ..site };
    let m = site.start().await;
    let (status, answer) = m.call(Tls::V12, &limited, "/v1/keys", Some(&body)).await;
    assert_eq!(status, 200, "renewed with the limited proxy: {answer}");
    let key: KeyView = serde_json::from_str(&answer).unwrap();
    assert_eq!(key.expires_at, earliest_not_after(&limited));
    m.stop().await;
}

#[tokio::test]
async fn bad_proxies_fail_the_handshake() {
    let site = Site::new();
    let m = site.start().await;
    let stranger = site.dir.path().join("mallory.pem");
    let legacy = site.proxy("alice", "alice-legacy.pem", &["-old"]);
    // In TLS 1.3 the client's certificate is judged after the client finished its side of the
    // handshake, so curl may report the closed connection rather than the alert; in TLS 1.2 it
    // always reports the alert.
    for tls in [Tls::V12, Tls::V13] {
        let out = m.curl(tls, &stranger, &stranger, "/v1/whoami", None).await;
        let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(!out.status.success(), "{tls:?}: {out:?}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("\"dn\""));
        if matches!(tls, Tls::V12) {
            assert!(stderr.contains("unknown ca"), "{tls:?}: {stderr}");
        }

        let out = m.curl(tls, &legacy, &legacy, "/v1/whoami", None).await;
        assert!(!out.status.success(), "{tls:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
        if matches!(tls, Tls::V12) {
            assert!(stderr.contains("alert"), "{tls:?}: {stderr}");
        }
    }
    // Without any certificate the connection works and user routes say 401.
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--capath"])
        .arg(&m.ca_dir)
        .arg(format!("https://127.0.0.1:{}/v1/whoami", m.addr.port()))
        .output()
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "401");
    m.stop().await;
}

/// A refusal made before the handler reads the body (no certificate: 401) reaches an HTTP/2
/// client whole, also while the client is still sending a large body: the manager reads the
/// body to its end first, instead of resetting the stream, which curl reports as a framing
/// error. A body over the API's limit is refused with a 413 that also arrives whole.
#[tokio::test]
async fn early_answers_reach_http2_clients_whole() {
    let site = Site::new();
    let m = site.start().await;
    let body_file = site.dir.path().join("body.json");
    for (size, expected) in [(64 * 1024, "401"), (3 * 1024 * 1024, "413")] {
        let padding = "x".repeat(size);
        std::fs::write(&body_file, format!("{{\"name\":\"{padding}\"}}")).unwrap();
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "--http2", "--max-time", "20", "-w", "\n%{http_code}"])
            .arg("--capath")
            .arg(&m.ca_dir)
            .args(["-X", "POST", "-H", "content-type: application/json"])
            .arg("--data-binary")
            .arg(format!("@{}", body_file.display()))
            .arg(format!("https://127.0.0.1:{}/v1/sessions", m.addr.port()))
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{size} bytes: curl failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (answer, status) = stdout.rsplit_once('\n').unwrap();
        assert_eq!(status, expected, "{size} bytes: {answer}");
        let error: ongrid_core::api::ErrorBody = serde_json::from_str(answer).unwrap();
        assert!(!error.error.message.is_empty(), "{answer}");
    }
    m.stop().await;
}
