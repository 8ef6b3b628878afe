//! Runs the built `devctl` binary: help texts, refusal of bad arguments (exit 2, core's
//! message), the one-line errors for missing credentials, an unreachable manager, a refused
//! client certificate and an untrusted server certificate, and every command against a fake
//! manager. The fake is a real rustls server configured as the manager's is (client
//! certificates required, verified against a CA directory); it records the method, target and
//! JSON body of each request, which the tests compare with what the API expects, and answers
//! with `ongrid_core::api` values. The full API against the real manager is covered by the
//! end-to-end suite.

// This file is all test code (`unwrap_used` is denied outside tests): a failed unwrap is a
// failed test.
#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};

use ongrid_core::api::{
    AddKey, AuditRecord, CreateSession, ErrorBody, ErrorDetail, GpuView, Institute, KeyView,
    NodeView, SessionView, SetGpuMode, WhoAmI,
};
use ongrid_core::api::{DashboardLink, DashboardLinkRequest, DrainRequest};
use ongrid_core::holds::{HoldRequest, KeepRequest};
use ongrid_core::image::{
    Compression, CreateImage, ImageProgress, ImageReference, ImageState, ImageView,
};
use ongrid_core::{
    Cidr, ComputeCapability, Dn, GpuHealth, GpuId, GpuInfo, GpuMode, GpuRequest, GpuUuid,
    InstituteName, MemorySize, NodeName, SessionId, SessionName, SessionState, Sharing, Transition,
    UserName,
};
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const DEVCTL: &str = env!("CARGO_BIN_EXE_devctl");
const DC: [u64; 7] = [0, 9, 2342, 19200300, 100, 1, 25];

/// Runs devctl with only the given environment (and `HOME` pointing at an empty directory, so
/// no user's config file is read).
async fn devctl(home: &Path, env: &[(&str, String)], args: &[&str]) -> Output {
    let uid = devctl::config::current_uid().expect("uid from /proc/self/status");
    let token_file = format!("/tmp/bt_u{uid}");
    assert!(
        !Path::new(&token_file).exists(),
        "{token_file} exists on this machine, so devctl would send that bearer token: move it \
         away to run these tests"
    );
    tokio::process::Command::new(DEVCTL)
        .env_clear()
        .env("HOME", home)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .args(args)
        .output()
        .await
        .expect("devctl runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Asserts a failure with exit code 1 and exactly one line on stderr, and returns that line.
fn one_line_error(output: &Output) -> String {
    let err = stderr(output);
    assert_eq!(output.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    err.trim_end().to_owned()
}

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CustomDnType(DC.to_vec()), "org");
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        Self { cert, key }
    }

    /// A certificate for `subject` (`O`, `CN`) with the given subject alternative names.
    fn issue(
        &self,
        organization: &str,
        common_name: &str,
        sans: &[&str],
    ) -> (rcgen::Certificate, KeyPair) {
        self.issue_with(organization, common_name, sans, |_| {})
    }

    fn issue_with(
        &self,
        organization: &str,
        common_name: &str,
        sans: &[&str],
        adjust: impl FnOnce(&mut CertificateParams),
    ) -> (rcgen::Certificate, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(sans).unwrap();
        adjust(&mut params);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CustomDnType(DC.to_vec()), "org");
        dn.push(DnType::OrganizationName, organization);
        dn.push(DnType::CommonName, common_name);
        params.distinguished_name = dn;
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert, key)
    }

    /// Writes this CA into `dir` as an IGTF-style `<name>.0` file.
    fn install(&self, dir: &Path, file: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(file), self.cert.pem()).unwrap();
    }
}

/// A user's world: a CA directory trusting `site_ca`, and a proxy-style file (certificate and
/// key in one PEM) for Alice issued by `user_ca`.
struct UserFiles {
    home: tempfile::TempDir,
    ca_dir: PathBuf,
    proxy: PathBuf,
}

impl UserFiles {
    fn new(site_ca: &Ca, user_ca: &Ca) -> Self {
        Self::with_cert(site_ca, user_ca.issue("Example", "Alice Smith", &[]))
    }

    fn with_cert(site_ca: &Ca, (cert, key): (rcgen::Certificate, KeyPair)) -> Self {
        let home = tempfile::tempdir().unwrap();
        let ca_dir = home.path().join("certificates");
        site_ca.install(&ca_dir, "1a2b3c4d.0");
        let proxy = home.path().join("x509up_u1000");
        write_private(&proxy, format!("{}{}", cert.pem(), key.serialize_pem()));
        Self {
            home,
            ca_dir,
            proxy,
        }
    }

    fn env(&self, manager_url: &str) -> Vec<(&'static str, String)> {
        vec![
            ("ONGRID_MANAGER_URL", manager_url.to_owned()),
            ("X509_USER_PROXY", self.proxy.display().to_string()),
            ("X509_CERT_DIR", self.ca_dir.display().to_string()),
        ]
    }
}

/// Writes a file only its owner may read, as devctl wants a key, proxy or config file.
fn write_private(path: &Path, contents: impl AsRef<[u8]>) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, contents).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// How devctl authenticated one request to the fake manager.
#[derive(Debug, Clone, PartialEq)]
struct Presented {
    /// The `Authorization` header, as sent.
    authorization: Option<String>,
    /// Whether the TLS client presented a certificate.
    certificate: bool,
}

/// Whether the fake manager's TLS asks for client certificates (as the manager always has) or
/// lets clients without one through (as a manager that takes bearer tokens does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientCertificates {
    Required,
    Optional,
}

/// What devctl sent the fake manager: the method, the request target (path and query as sent,
/// URL-encoded), and the JSON body, if any.
#[derive(Debug, Clone, PartialEq)]
struct Sent {
    method: &'static str,
    target: String,
    body: Option<Value>,
}

impl Sent {
    fn new(method: &'static str, target: &str) -> Self {
        Self {
            method,
            target: target.to_owned(),
            body: None,
        }
    }

    /// With the JSON of one of `ongrid_core::api`'s request types as the body.
    fn json(self, body: &impl Serialize) -> Self {
        Self {
            body: Some(serde_json::to_value(body).unwrap()),
            ..self
        }
    }
}

/// One scripted answer of the fake manager: a status and the JSON of an `ongrid_core::api`
/// type.
#[derive(Debug, Clone)]
struct Answer {
    status: &'static str,
    body: Value,
}

impl Answer {
    fn ok(body: &impl Serialize) -> Self {
        Self::with_status("200 OK", body)
    }

    fn with_status(status: &'static str, body: &impl Serialize) -> Self {
        Self {
            status,
            body: serde_json::to_value(body).unwrap(),
        }
    }

    /// The API's error body.
    fn error(status: &'static str, code: &str, message: &str) -> Self {
        Self::with_status(
            status,
            &ErrorBody {
                error: ErrorDetail {
                    code: code.to_owned(),
                    message: message.to_owned(),
                },
            },
        )
    }

    fn to_http(&self) -> String {
        let body = self.body.to_string();
        format!(
            "HTTP/1.1 {}\r\ncontent-type: application/json\r\nconnection: close\r\n\
             content-length: {}\r\n\r\n{body}",
            self.status,
            body.len()
        )
    }
}

/// A TLS server as the manager runs it: its certificate from `server_ca`, client certificates
/// required and verified against `client_ca`. It records every request whose handshake
/// succeeds and answers them with `answers`, in order; a request past the script gets a 500
/// whose message says so, which devctl prints.
struct FakeManager {
    url: String,
    sent: Arc<Mutex<Vec<Sent>>>,
    presented: Arc<Mutex<Vec<Presented>>>,
}

impl FakeManager {
    async fn start(server_ca: &Ca, client_ca: &Ca, answers: Vec<Answer>) -> Self {
        Self::start_with(server_ca, client_ca, answers, ClientCertificates::Required).await
    }

    async fn start_with(
        server_ca: &Ca,
        client_ca: &Ca,
        answers: Vec<Answer>,
        client_certificates: ClientCertificates,
    ) -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(client_ca.cert.der().clone()).unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        );
        let verifier = match client_certificates {
            ClientCertificates::Required => verifier,
            ClientCertificates::Optional => verifier.allow_unauthenticated(),
        }
        .build()
        .unwrap();
        let (cert, key) = server_ca.issue("Example", "manager", &["127.0.0.1"]);
        let chain: Vec<CertificateDer<'static>> = vec![cert.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let sent = Arc::new(Mutex::new(Vec::new()));
        let recorded = sent.clone();
        let presented = Arc::new(Mutex::new(Vec::new()));
        let recorded_presented = presented.clone();
        let answers = Arc::new(Mutex::new(VecDeque::from(answers)));
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let Ok(mut tls) = acceptor.clone().accept(tcp).await else {
                    continue;
                };
                // One request per connection (answers say `connection: close`), in the order
                // devctl sends them.
                let certificate = tls.get_ref().1.peer_certificates().is_some();
                let Some((request, authorization)) = read_request(&mut tls).await else {
                    continue;
                };
                recorded.lock().unwrap().push(request);
                recorded_presented.lock().unwrap().push(Presented {
                    authorization,
                    certificate,
                });
                let answer = answers.lock().unwrap().pop_front().unwrap_or_else(|| {
                    Answer::error(
                        "500 Internal Server Error",
                        "internal",
                        "the fake manager has no answer scripted for this request",
                    )
                });
                let _ = tls.write_all(answer.to_http().as_bytes()).await;
                let _ = tls.shutdown().await;
            }
        });
        Self {
            url,
            sent,
            presented,
        }
    }

    /// The requests received so far.
    fn sent(&self) -> Vec<Sent> {
        self.sent.lock().unwrap().clone()
    }

    /// How each request received so far was authenticated.
    fn presented(&self) -> Vec<Presented> {
        self.presented.lock().unwrap().clone()
    }
}

/// Reads one HTTP/1.1 request: request line, headers, and a `content-length` body; with the
/// `Authorization` header, if any.
async fn read_request(
    tls: &mut tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
) -> Option<(Sent, Option<String>)> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        match tls.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8(data[..head_end].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap().split(' ');
    let method = match request_line.next().unwrap() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        other => panic!("unexpected method {other}"),
    };
    let target = request_line.next().unwrap().to_owned();
    let headers: Vec<(&str, &str)> = lines.filter_map(|line| line.split_once(':')).collect();
    let header = |wanted: &str| {
        headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(wanted))
            .map(|(_, value)| value.trim().to_owned())
    };
    let length: usize = header("content-length").map_or(0, |value| value.parse().unwrap());
    let authorization = header("authorization");
    while data.len() < head_end + length {
        match tls.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    let body = &data[head_end..head_end + length];
    let body = (!body.is_empty()).then(|| serde_json::from_slice(body).unwrap());
    Some((
        Sent {
            method,
            target,
            body,
        },
        authorization,
    ))
}

fn key_view() -> KeyView {
    KeyView {
        fingerprint: "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI".into(),
        algorithm: "ssh-ed25519".into(),
        comment: "alice@laptop".into(),
        owner: Dn::parse("/DC=org/O=Example/CN=Alice Smith").unwrap(),
        added_at: "2026-11-21T10:00:00Z".parse().unwrap(),
        expires_at: "2026-11-22T10:00:00Z".parse().unwrap(),
    }
}

fn whoami_view() -> WhoAmI {
    WhoAmI {
        dn: Dn::parse("/DC=org/O=Example/CN=Alice Smith").unwrap(),
        user_name: UserName::parse("alice-smith").unwrap(),
        uid: 20000,
        admin: true,
        credential: None,
        vos: Vec::new(),
        fqans: Vec::new(),
        not_after: None,
        group: None,
        admitted_by: None,
        token: None,
    }
}

#[tokio::test]
async fn every_command_has_help() {
    let home = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--help"],
            &[
                "Usage: devctl",
                "whoami",
                "session",
                "gpus",
                "admin",
                "X509_USER_PROXY",
                "ONGRID_MANAGER_URL",
            ],
        ),
        (&["whoami", "--help"], &["Usage: devctl whoami", "--json"]),
        (&["share", "--help"], &["Usage: devctl share", "--json"]),
        (
            &["session", "--help"],
            &["Usage: devctl session", "new", "ls", "show", "rm", "web"],
        ),
        (
            &["session", "web", "--help"],
            &[
                "<NAME>",
                "--port <PORT>",
                "--no-open",
                "$BROWSER",
                "xdg-open",
            ],
        ),
        (
            &["session", "new", "--help"],
            &[
                "--name",
                "--gpus",
                "--min-capability",
                "--min-gpu-memory",
                "--share",
                "--image",
                "--wait",
                "--timeout",
                "--json",
            ],
        ),
        (&["session", "ls", "--help"], &["--all", "--json"]),
        (
            &["session", "show", "--help"],
            &["<NAME>", "--owner", "--json"],
        ),
        (&["session", "rm", "--help"], &["<NAME>", "--owner"]),
        (&["gpus", "--help"], &["Usage: devctl gpus", "--json"]),
        (
            &["key", "--help"],
            &["Usage: devctl key", "add", "ls", "rm"],
        ),
        (
            &["key", "add", "--help"],
            &["[PUBKEY_FILE]", "~/.ssh/id_ed25519.pub", "--json"],
        ),
        (&["key", "ls", "--help"], &["--all", "--json"]),
        (&["key", "rm", "--help"], &["<FINGERPRINT>"]),
        (&["admin", "--help"], &["gpu", "institute", "audit"]),
        (
            &["admin", "institute", "--help"],
            &["add", "rm", "ls", "show"],
        ),
        (
            &["admin", "institute", "add", "--help"],
            &["<NAME>", "<CIDR>..."],
        ),
        (
            &["admin", "audit", "--help"],
            &["--user", "--since", "TIME|DURATION", "--json"],
        ),
        (&["admin", "gpu", "--help"], &["mode"]),
        (
            &["job", "--help"],
            &["submit", "ls", "show", "logs", "cancel", "halt", "rm"],
        ),
        (
            &["job", "rm", "--help"],
            &["<ID>...", "cancel it first", "--json"],
        ),
        (
            &["job", "submit", "--help"],
            &[
                "[JOB_FILE]",
                "--image",
                "--gpus",
                "--max-duration",
                "--min-duration",
                "--restartable",
                "--not-before",
                "--not-after",
                "--bucket",
                "--env",
                "--home",
                "[COMMAND]...",
            ],
        ),
        (&["job", "logs", "--help"], &["<ID>", "--follow", "16 MiB"]),
        (
            &["admin", "gpu", "mode", "--help"],
            &["<GPU>", "exclusive|shared:N"],
        ),
    ];
    for (args, expected) in cases {
        let output = devctl(home.path(), &[], args).await;
        assert_eq!(
            output.status.code(),
            Some(0),
            "{args:?}: {}",
            stderr(&output)
        );
        let text = stdout(&output);
        for word in *expected {
            assert!(text.contains(word), "{args:?} help lacks {word:?}:\n{text}");
        }
    }
}

#[tokio::test]
async fn bad_arguments_exit_2_with_the_core_message() {
    let home = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["session", "new", "--name", "Train_1"],
            "session name \"Train_1\" may only contain lower-case letters, digits and '-'",
        ),
        (
            &["session", "new", "--min-capability", "8"],
            "compute capability \"8\" must look like 8.0 (major.minor)",
        ),
        (
            &["session", "new", "--min-gpu-memory", "lots"],
            "memory size \"lots\" must be a number with a unit, like 40G, 40960M or 40GiB",
        ),
        (
            &["session", "new", "--gpus", "0"],
            "a session needs at least 1 GPU",
        ),
        (
            &["session", "show", "Bad"],
            "session name \"Bad\" may only contain",
        ),
        (
            &["session", "web", "train1", "--port", "0"],
            "0 is not in 1..=65535",
        ),
        (
            &["session", "web", "train1", "--port", "65536"],
            "65536 is not in 1..=65535",
        ),
        (
            &["admin", "institute", "add", "local", "10.1.2.3/16"],
            "\"10.1.2.3/16\" has host bits set: the network is 10.1.0.0/16",
        ),
        (
            &[
                "admin",
                "institute",
                "add",
                "local",
                "127.0.0.0/8",
                "localhost",
            ],
            "\"localhost\" is not an IP network: write it like 192.0.2.0/24 or 2001:db8::/32",
        ),
        (
            &["admin", "institute", "add", "Uni_Glasgow", "130.209.0.0/16"],
            "institute name \"Uni_Glasgow\" must be 1 to 64 lower-case letters, digits, '-', \
             '_' or '.', starting with a letter or digit",
        ),
        (
            &["admin", "institute", "rm", ".hidden"],
            "institute name \".hidden\" must be",
        ),
        (
            &[
                "key",
                "rm",
                "MD5:16:27:ac:a5:76:28:2d:36:63:1b:56:4d:eb:df:a6:48",
            ],
            "must look like SHA256:",
        ),
        (
            &["admin", "audit", "--since", "last tuesday"],
            "must be a time like 2026-11-21T10:00:00Z or 2026-11-21 (UTC), or a duration",
        ),
    ];
    for (args, message) in cases {
        // A manager URL is set so that only the arguments can be at fault.
        let env = [("ONGRID_MANAGER_URL", "https://127.0.0.1:1".to_owned())];
        let output = devctl(home.path(), &env, args).await;
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn key_add_refuses_missing_and_private_key_files() {
    let ca = Ca::new("Site CA");
    let files = UserFiles::new(&ca, &ca);
    // The manager is unreachable: each refusal must come before any request.
    let env = files.env("https://127.0.0.1:1");
    let home = files.home.path();

    let output = devctl(home, &env, &["key", "add"]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: no SSH public key found (tried {h}/.ssh/id_ed25519.pub, {h}/.ssh/id_ecdsa.pub, \
             {h}/.ssh/id_rsa.pub): create a key pair with ssh-keygen -t ed25519, or name the \
             file: devctl key add FILE",
            h = home.display()
        )
    );

    let missing = home.join("nope.pub");
    let output = devctl(home, &env, &["key", "add", missing.to_str().unwrap()]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: public key file {} does not exist: create a key pair with ssh-keygen -t \
             ed25519, or name another file",
            missing.display()
        )
    );

    let ssh = home.join(".ssh");
    std::fs::create_dir(&ssh).unwrap();
    let private = ssh.join("id_ed25519");
    std::fs::write(
        &private,
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjE=\n-----END OPENSSH PRIVATE KEY-----\n",
    )
    .unwrap();
    std::fs::write(ssh.join("id_ed25519.pub"), format!("{ED25519_KEY}\n")).unwrap();
    let output = devctl(home, &env, &["key", "add", private.to_str().unwrap()]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: {p} is a private key, which must never leave your machine: give its public \
             key, devctl key add {p}.pub",
            p = private.display()
        )
    );
}

const ED25519_KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop";

#[tokio::test]
async fn key_add_sends_the_default_key_and_prints_its_expiry() {
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![Answer::with_status("201 Created", &key_view())],
    )
    .await;
    let url = manager.url.clone();
    let files = UserFiles::new(&ca, &ca);
    let ssh = files.home.path().join(".ssh");
    std::fs::create_dir(&ssh).unwrap();
    // id_ed25519.pub is preferred over id_rsa.pub.
    std::fs::write(ssh.join("id_ed25519.pub"), format!("{ED25519_KEY}\n")).unwrap();
    std::fs::write(
        ssh.join("id_rsa.pub"),
        "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 x\n",
    )
    .unwrap();
    let output = devctl(files.home.path(), &files.env(&url), &["key", "add"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(
        stderr(&output),
        format!(
            "public key file: {}\n",
            ssh.join("id_ed25519.pub").display()
        )
    );
    assert_eq!(
        stdout(&output),
        "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519, alice@laptop) \
         added\nexpires 2026-11-22 10:00:00Z (with the certificate or proxy used)\n"
    );
    assert_eq!(
        manager.sent(),
        [Sent::new("POST", "/v1/keys").json(&AddKey {
            public_key: ED25519_KEY.to_owned()
        })]
    );
}

#[tokio::test]
async fn missing_credentials_say_where_devctl_looked() {
    let home = tempfile::tempdir().unwrap();
    let uid = devctl::config::current_uid().expect("uid from /proc/self/status");
    let default_proxy = format!("/tmp/x509up_u{uid}");
    assert!(
        !Path::new(&default_proxy).exists(),
        "{default_proxy} exists on this machine, so devctl would use it: move it away to run this test"
    );
    let env = [("ONGRID_MANAGER_URL", "https://127.0.0.1:1".to_owned())];
    let output = devctl(home.path(), &env, &["session", "ls"]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: no grid certificate found (X509_USER_CERT and X509_USER_PROXY are not set, no \
             config file, {default_proxy} does not exist): run voms-proxy-init (or \
             grid-proxy-init), or set X509_USER_PROXY, or X509_USER_CERT and X509_USER_KEY"
        )
    );
}

#[tokio::test]
async fn missing_manager_url_names_the_settings() {
    let home = tempfile::tempdir().unwrap();
    let output = devctl(home.path(), &[], &["gpus"]).await;
    assert_eq!(
        one_line_error(&output),
        "error: no manager URL: set ONGRID_MANAGER_URL or manager_url in ~/.config/ongrid/devctl.toml"
    );
}

#[tokio::test]
async fn an_unreachable_manager_says_so() {
    let ca = Ca::new("Site CA");
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env("https://127.0.0.1:1"),
        &["whoami"],
    )
    .await;
    assert_eq!(
        one_line_error(&output),
        "error: cannot reach the manager at https://127.0.0.1:1 (connection refused): is it \
         running? (set ONGRID_MANAGER_URL or manager_url in ~/.config/ongrid/devctl.toml)"
    );
}

#[tokio::test]
async fn settings_come_from_the_config_file() {
    let ca = Ca::new("Site CA");
    let files = UserFiles::new(&ca, &ca);
    let config_dir = files.home.path().join(".config/ongrid");
    std::fs::create_dir_all(&config_dir).unwrap();
    write_private(
        &config_dir.join("devctl.toml"),
        format!(
            "manager_url = \"https://127.0.0.1:1\"\ncert = \"{}\"\nca_dir = \"{}\"\n",
            files.proxy.display(),
            files.ca_dir.display()
        ),
    );
    let output = devctl(files.home.path(), &[], &["session", "ls"]).await;
    assert!(
        one_line_error(&output)
            .starts_with("error: cannot reach the manager at https://127.0.0.1:1 "),
        "{}",
        stderr(&output)
    );
}

/// A proxy, a private key or a config file that its group or others may read is refused before
/// anything is sent, naming the file and the `chmod` that fixes it; once fixed, devctl goes on.
#[tokio::test]
async fn credentials_and_config_others_may_read_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(&ca, &ca, vec![Answer::ok(&whoami_view())]).await;
    let files = UserFiles::new(&ca, &ca);
    let refusal = |what: &str, path: &Path, mode: u32| {
        format!(
            "error: {what} {p} has mode {mode:04o}, open to its group or others, which devctl \
             refuses as ssh does: run `chmod 600 {p}`",
            p = path.display()
        )
    };

    // The proxy (X509_USER_PROXY).
    for bits in [0o644, 0o640, 0o604] {
        mode(&files.proxy, bits);
        let output = devctl(files.home.path(), &files.env(&manager.url), &["whoami"]).await;
        assert_eq!(
            one_line_error(&output),
            refusal("proxy file", &files.proxy, bits)
        );
    }
    mode(&files.proxy, 0o600);

    // A certificate (public, 0644) with its key in another file (X509_USER_KEY).
    let (cert, key) = ca.issue("Example", "Alice Smith", &[]);
    let cert_path = files.home.path().join("usercert.pem");
    let key_path = files.home.path().join("userkey.pem");
    std::fs::write(&cert_path, cert.pem()).unwrap();
    mode(&cert_path, 0o644);
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    mode(&key_path, 0o644);
    let pair = vec![
        ("ONGRID_MANAGER_URL", manager.url.clone()),
        ("X509_USER_CERT", cert_path.display().to_string()),
        ("X509_USER_KEY", key_path.display().to_string()),
        ("X509_CERT_DIR", files.ca_dir.display().to_string()),
    ];
    let output = devctl(files.home.path(), &pair, &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        refusal("private key file", &key_path, 0o644)
    );

    // The config file, which names the key.
    let config = files.home.path().join(".config/ongrid/devctl.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(
        &config,
        format!(
            "manager_url = \"{}\"\ncert = \"{}\"\nca_dir = \"{}\"\n",
            manager.url,
            files.proxy.display(),
            files.ca_dir.display()
        ),
    )
    .unwrap();
    mode(&config, 0o644);
    let output = devctl(files.home.path(), &[], &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        refusal("config file", &config, 0o644)
    );
    assert!(
        manager.sent().is_empty(),
        "nothing was sent: {:?}",
        manager.sent()
    );

    // Fixed as told, the same command goes through.
    mode(&config, 0o600);
    let output = devctl(files.home.path(), &[], &["whoami"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(manager.sent(), [Sent::new("GET", "/v1/whoami")]);
}

#[tokio::test]
async fn a_refused_certificate_is_named_by_its_dn() {
    let site_ca = Ca::new("Site CA");
    let stranger_ca = Ca::new("Stranger CA");
    // The manager trusts only the site CA for clients; Alice's certificate is from another.
    let url = FakeManager::start(&site_ca, &site_ca, vec![Answer::ok(&whoami_view())])
        .await
        .url;
    let files = UserFiles::new(&site_ca, &stranger_ca);
    let output = devctl(files.home.path(), &files.env(&url), &["whoami"]).await;
    // The manager's unknown_ca alert: the issuer, and where the manager looks CAs up.
    assert_eq!(
        one_line_error(&output),
        "error: the manager does not trust the CA of your certificate \
         /DC=org/O=Example/CN=Alice Smith (issuer /DC=org/CN=Stranger CA): the manager reads its \
         CAs from its ca_dir (IGTF layout, usually /etc/grid-security/certificates); use a \
         certificate from a CA the site trusts, or ask the site admins to install yours"
    );
}

#[tokio::test]
async fn an_expired_certificate_is_called_expired() {
    let ca = Ca::new("Site CA");
    let url = FakeManager::start(&ca, &ca, vec![Answer::ok(&whoami_view())])
        .await
        .url;
    let expired = ca.issue_with("Example", "Alice Smith", &[], |params| {
        params.not_before = rcgen::date_time_ymd(2024, 1, 1);
        params.not_after = rcgen::date_time_ymd(2024, 1, 2);
    });
    let files = UserFiles::with_cert(&ca, expired);
    let output = devctl(files.home.path(), &files.env(&url), &["whoami"]).await;
    // Caught by devctl's own check of the chain, before any connection.
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: cannot use {} (from X509_USER_PROXY): user certificate \
             /DC=org/O=Example/CN=Alice Smith expired at 2024-01-02 00:00 UTC: renew it with your \
             CA, then make a new proxy",
            files.proxy.display()
        )
    );
}

#[tokio::test]
async fn an_untrusted_manager_certificate_names_the_ca_dir() {
    let site_ca = Ca::new("Site CA");
    let other_ca = Ca::new("Other CA");
    // The manager's certificate is from a CA that the user's CA directory does not hold.
    let url = FakeManager::start(&other_ca, &site_ca, vec![Answer::ok(&whoami_view())])
        .await
        .url;
    let files = UserFiles::new(&site_ca, &site_ca);
    let output = devctl(files.home.path(), &files.env(&url), &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: cannot verify the manager's certificate against CA dir {} (issued by a CA \
             that is not in it): set X509_CERT_DIR",
            files.ca_dir.display()
        )
    );
}

#[tokio::test]
async fn an_api_error_prints_its_message() {
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![Answer::error(
            "404 Not Found",
            "not_found",
            "no session train1: list yours with devctl session ls",
        )],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["session", "show", "train1"],
    )
    .await;
    assert_eq!(
        one_line_error(&output),
        "error: no session train1: list yours with devctl session ls"
    );
    assert_eq!(manager.sent(), [Sent::new("GET", "/v1/sessions/train1")]);
}

#[tokio::test]
async fn an_accepted_certificate_gets_an_answer() {
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![Answer::ok(&whoami_view()), Answer::ok(&whoami_view())],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let env = files.env(&manager.url);
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(
        stdout(&output),
        "dn:     /DC=org/O=Example/CN=Alice Smith\nlogin:  alice-smith\nuid:    20000\nadmin:  yes\n"
    );
    let output = devctl(files.home.path(), &env, &["whoami", "--json"]).await;
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json, serde_json::to_value(whoami_view()).unwrap());
    assert_eq!(
        manager.sent(),
        [
            Sent::new("GET", "/v1/whoami"),
            Sent::new("GET", "/v1/whoami")
        ]
    );
}

// Bearer tokens (WLCG, SciTokens) in place of the certificate.

/// A JWT with `claims`, signed with HS256 and a made-up secret: devctl reads its claims without
/// verifying it (the manager verifies), so the signature does not matter here.
fn jwt(claims: &Value) -> String {
    let key = jsonwebtoken::EncodingKey::from_secret(b"not the issuer's key").unwrap();
    jsonwebtoken::encode(&jsonwebtoken::Header::default(), claims, &key).unwrap()
}

/// A token of Alice's from the CMS issuer, expiring `valid_secs` from now.
fn alice_token(valid_secs: i64) -> String {
    jwt(&serde_json::json!({
        "iss": "https://iam.test.invalid/",
        "sub": "e1eb758b-b73c-4761-bfff-adc793da409c",
        "exp": chrono::Utc::now().timestamp() + valid_secs,
        "scope": "compute.create compute.read",
        "wlcg.groups": ["/cms"],
    }))
}

fn token_whoami_view() -> WhoAmI {
    WhoAmI {
        credential: Some(ongrid_core::api::CredentialKind::Token),
        not_after: Some(chrono::Utc::now() + chrono::TimeDelta::hours(2)),
        group: Some("cms".into()),
        admitted_by: Some("group /cms".into()),
        token: Some(ongrid_core::api::TokenInfo {
            issuer: "https://iam.test.invalid/".into(),
            subject: "e1eb758b-b73c-4761-bfff-adc793da409c".into(),
            groups: vec!["/cms".into()],
            scopes: vec!["compute.create".into(), "compute.read".into()],
        }),
        ..whoami_view()
    }
}

/// With `BEARER_TOKEN_FILE` set, devctl sends `Authorization: Bearer <the token>` and presents
/// no client certificate (though a proxy is set too), still checking the manager's certificate;
/// whoami names where the token came from and what the manager read from it. With `--cert`,
/// the certificate is presented and no token sent.
#[tokio::test]
async fn a_bearer_token_is_sent_instead_of_a_certificate() {
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start_with(
        &ca,
        &ca,
        vec![
            Answer::ok(&token_whoami_view()),
            Answer::ok(&token_whoami_view()),
            Answer::ok(&whoami_view()),
        ],
        ClientCertificates::Optional,
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let token = alice_token(3600);
    let token_file = files.home.path().join("bt_u1000");
    write_private(&token_file, format!("{token}\n"));
    let mut env = files.env(&manager.url);
    env.push(("BEARER_TOKEN_FILE", token_file.display().to_string()));

    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.contains(&format!(
            "credential:  bearer token (BEARER_TOKEN_FILE {})\n\
             issuer:      https://iam.test.invalid/\n\
             subject:     e1eb758b-b73c-4761-bfff-adc793da409c\n\
             groups:      /cms\n\
             scopes:      compute.create, compute.read\n\
             time left:   1h 59m (until ",
            token_file.display()
        )),
        "{text}"
    );
    assert!(!text.contains("vo:"), "{text}");
    let output = devctl(files.home.path(), &env, &["whoami", "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["credential"], "token");
    assert_eq!(
        json["token"]["subject"],
        "e1eb758b-b73c-4761-bfff-adc793da409c"
    );

    let output = devctl(
        files.home.path(),
        &env,
        &["--cert", files.proxy.to_str().unwrap(), "whoami"],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));

    let bearer = Presented {
        authorization: Some(format!("Bearer {token}")),
        certificate: false,
    };
    assert_eq!(
        manager.presented(),
        [
            bearer.clone(),
            bearer,
            Presented {
                authorization: None,
                certificate: true,
            }
        ]
    );
    assert_eq!(manager.sent(), vec![Sent::new("GET", "/v1/whoami"); 3]);
}

/// `BEARER_TOKEN` (the token itself) is used, and a manager's 401 or 403 names where the token
/// came from; a manager that wants a client certificate says so and names `--cert`.
#[tokio::test]
async fn refusals_of_a_token_name_where_it_came_from() {
    let ca = Ca::new("Site CA");
    let message = "the token's issuer https://other.test.invalid/ is not one this site trusts: \
                   use a token from https://iam.test.invalid/";
    let manager = FakeManager::start_with(
        &ca,
        &ca,
        vec![
            Answer::error("401 Unauthorized", "unauthenticated", message),
            Answer::error(
                "403 Forbidden",
                "forbidden",
                "the token has no compute.create scope",
            ),
        ],
        ClientCertificates::Optional,
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let token = alice_token(3600);
    let env = vec![
        ("ONGRID_MANAGER_URL", manager.url.clone()),
        ("X509_CERT_DIR", files.ca_dir.display().to_string()),
        ("BEARER_TOKEN", token.clone()),
    ];
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        format!("error: the manager refused the bearer token from BEARER_TOKEN: {message}")
    );
    let output = devctl(files.home.path(), &env, &["session", "new"]).await;
    assert_eq!(
        one_line_error(&output),
        "error: the manager refused the bearer token from BEARER_TOKEN: the token has no \
         compute.create scope"
    );
    assert!(
        !stderr(&output).contains(&token),
        "the token is never printed"
    );
    assert_eq!(
        manager.presented()[0].authorization,
        Some(format!("Bearer {token}"))
    );

    // A manager that asks for a client certificate (one that takes no tokens).
    let strict = FakeManager::start(&ca, &ca, vec![Answer::ok(&whoami_view())]).await;
    let mut env = env;
    env[0].1 = strict.url.clone();
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: the manager at {} asked for a client certificate and took no bearer token \
             (from BEARER_TOKEN): if the site does not accept tokens, use your certificate or \
             proxy with --cert FILE",
            strict.url
        )
    );
    assert!(strict.sent().is_empty());
}

/// An expired token, an empty token file, something that is not a JWT, and a token file others
/// may read are refused before anything is sent, naming the file and the fix.
#[tokio::test]
async fn unusable_tokens_are_refused_before_sending() {
    use std::os::unix::fs::PermissionsExt;
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start_with(&ca, &ca, Vec::new(), ClientCertificates::Optional).await;
    let files = UserFiles::new(&ca, &ca);
    let runtime = files.home.path().join("run");
    std::fs::create_dir(&runtime).unwrap();
    let uid = devctl::config::current_uid().unwrap();
    // Found by discovery in $XDG_RUNTIME_DIR, before the proxy that is set too.
    let token_file = runtime.join(format!("bt_u{uid}"));
    let mut env = files.env(&manager.url);
    env.push(("XDG_RUNTIME_DIR", runtime.display().to_string()));
    let p = token_file.display().to_string();
    let fix = format!("get a new one (oidc-token ACCOUNT > {p}, or htgettoken)");

    write_private(&token_file, alice_token(-90));
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    let line = one_line_error(&output);
    assert!(
        line.starts_with(&format!("error: the bearer token from {p} expired at ")),
        "{line}"
    );
    assert!(line.ends_with(&format!(" ago): {fix}")), "{line}");

    write_private(&token_file, "\n");
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        format!("error: the bearer token from {p} is empty: {fix}")
    );

    write_private(&token_file, "not-a-jwt\n");
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: the bearer token from {p} is not a JWT (it is not three base64url parts \
             separated by dots): {fix}"
        )
    );

    write_private(&token_file, alice_token(3600));
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let output = devctl(files.home.path(), &env, &["whoami"]).await;
    assert_eq!(
        one_line_error(&output),
        format!(
            "error: bearer token file {p} has mode 0640, open to its group or others, which \
             devctl refuses as ssh does: run `chmod 600 {p}`"
        )
    );
    assert!(manager.sent().is_empty(), "{:?}", manager.sent());
}

// Every command against the fake manager: what devctl sends, and what it prints.

const ALICE: &str = "/DC=org/O=Example/CN=Alice Smith";
/// `?owner=` + ALICE, form-encoded as reqwest sends it.
const OWNER_QUERY: &str = "owner=%2FDC%3Dorg%2FO%3DExample%2FCN%3DAlice+Smith";
const FINGERPRINT: &str = "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI";
const UUID_A: &str = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f";
const SESSION_ID: &str = "6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f";
const DIGEST: &str = "sha256:98fbda8214f8eb5cf69a46a4e0318c561d172754e49e6d6e3ac8d585285e0229";

fn time(text: &str) -> chrono::DateTime<chrono::Utc> {
    text.parse().unwrap()
}

fn session_view(state: SessionState) -> SessionView {
    SessionView {
        id: SessionId(SESSION_ID.parse().unwrap()),
        name: SessionName::parse("train1").unwrap(),
        owner: Dn::parse(ALICE).unwrap(),
        user_name: UserName::parse("alice-smith").unwrap(),
        state,
        reason: "placed on node1".into(),
        request: GpuRequest::default(),
        image: "ongrid/dev:latest".into(),
        node: Some(NodeName::parse("node1").unwrap()),
        gpus: vec![GpuId::parse(UUID_A).unwrap()],
        container: "ongrid-6f1c2d3e4a5b4c6d8e9f0a1b2c3d4e5f".into(),
        created_at: time("2026-11-21T10:00:03Z"),
        queue_position: None,
        transitions: vec![Transition {
            from: None,
            to: SessionState::Pending,
            at: time("2026-11-21T10:00:03Z"),
            reason: "created".into(),
        }],
        lifecycle: None,
    }
}

fn pending_view(position: u32) -> SessionView {
    SessionView {
        node: None,
        gpus: vec![],
        queue_position: Some(position),
        reason: "created".into(),
        ..session_view(SessionState::Pending)
    }
}

fn gpu_view(mode: GpuMode) -> GpuView {
    GpuView {
        info: GpuInfo {
            uuid: GpuUuid::parse(UUID_A).unwrap(),
            model: "NVIDIA A100-SXM4-40GB".into(),
            capability: ComputeCapability::new(8, 0),
            memory: MemorySize::from_mib(40_960),
            pci_bus_id: None,
            driver_version: None,
            mig_enabled: false,
            health: GpuHealth::Healthy,
            utilization_percent: None,
            mig_devices: Vec::new(),
            mig_waiting: None,
        },
        node: NodeName::parse("node1").unwrap(),
        mode,
        used: 1,
        free: mode.capacity() - 1,
        sessions: vec![SessionName::parse("train1").unwrap()],
        drain: None,
        mig_sessions: Default::default(),
    }
}

fn node_view(sessions: u32, jobs: u32, drain: Option<ongrid_core::gpu::Drain>) -> NodeView {
    NodeView {
        name: NodeName::parse("node1").unwrap(),
        online: true,
        last_seen: time("2026-11-21T10:00:00Z"),
        gpu_backend: "simulated".into(),
        gpus: vec![gpu_view(GpuMode::Exclusive)],
        agent_version: "0.1.0".into(),
        drain,
        sessions,
        jobs,
    }
}

fn drain(reason: &str) -> Option<ongrid_core::gpu::Drain> {
    Some(ongrid_core::gpu::Drain {
        reason: reason.into(),
        since: time("2026-11-21T10:00:00Z"),
        by: "alice".into(),
    })
}

fn institute_view() -> Institute {
    Institute {
        name: InstituteName::parse("local").unwrap(),
        cidrs: vec![
            Cidr::parse("127.0.0.0/8").unwrap(),
            Cidr::parse("::1/128").unwrap(),
        ],
    }
}

fn audit_record() -> AuditRecord {
    AuditRecord {
        connection_id: "9b2e8a4c-1d3f-4e5a-8b7c-6d5e4f3a2b1c".parse().unwrap(),
        owner: Dn::parse(ALICE).unwrap(),
        fingerprint: key_view().fingerprint,
        source: "192.0.2.7".parse().unwrap(),
        institute: InstituteName::parse("local").unwrap(),
        session_id: SessionId(SESSION_ID.parse().unwrap()),
        session_name: SessionName::parse("train1").unwrap(),
        opened_at: time("2026-11-21T10:01:00Z"),
        closed_at: None,
        bytes_in: 1536,
        bytes_out: 0,
        close_reason: None,
    }
}

fn image_view(state: ImageState) -> ImageView {
    let ready = state == ImageState::Ready;
    ImageView {
        id: "1059acb6-44be-478d-a0f7-02810ec78a7d".parse().unwrap(),
        name: "mymodel".into(),
        version: "v1".into(),
        reference: "mymodel:v1".into(),
        owner: Dn::parse(ALICE).unwrap(),
        user_name: UserName::parse("alice-smith").unwrap(),
        state,
        reason: "frozen on node1".into(),
        digest: ready.then(|| DIGEST.to_owned()),
        size: ready.then_some(83_058_688),
        sif_path: ready.then(|| format!("/images/sha256/{}.sif", &DIGEST[7..])),
        docker_image: ready.then(|| "ongrid/alice-smith/mymodel:v1".to_owned()),
        node: NodeName::parse("node1").unwrap(),
        session: SessionName::parse("train1").unwrap(),
        session_id: SessionId(SESSION_ID.parse().unwrap()),
        base_image: "ongrid/dev:latest".into(),
        compression: Compression::Gzip,
        created_at: time("2026-11-22T00:33:56Z"),
        finished_at: ready.then(|| time("2026-11-22T00:35:04Z")),
        superseded_at: None,
        progress: (!ready).then_some(ImageProgress {
            bytes_done: 0,
            bytes_total: 0,
        }),
        shared: false,
    }
}

/// One devctl invocation against a fresh fake manager.
struct Case {
    args: &'static [&'static str],
    answers: Vec<Answer>,
    /// What devctl must send, in order.
    sent: Vec<Sent>,
    /// What stdout must contain; with `--json` in `args`, stdout must be the last answer's
    /// JSON instead.
    stdout: &'static str,
}

async fn check(case: Case) {
    let ca = Ca::new("Site CA");
    let last_answer = case.answers.last().map(|a| a.body.clone());
    let manager = FakeManager::start(&ca, &ca, case.answers).await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(files.home.path(), &files.env(&manager.url), case.args).await;
    let args = case.args.join(" ");
    assert_eq!(
        output.status.code(),
        Some(0),
        "devctl {args}: {}",
        stderr(&output)
    );
    assert_eq!(manager.sent(), case.sent, "devctl {args}");
    let text = stdout(&output);
    if case.args.contains(&"--json") {
        let json: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(Some(json), last_answer, "devctl {args}");
    } else {
        assert!(
            text.contains(case.stdout),
            "devctl {args} prints {:?}:\n{text}",
            case.stdout
        );
    }
}

#[tokio::test]
async fn session_commands_send_their_routes_and_bodies() {
    let cases = vec![
        Case {
            args: &[
                "session",
                "new",
                "--name",
                "train1",
                "--gpus",
                "2",
                "--min-capability",
                "8.0",
                "--min-gpu-memory",
                "40G",
                "--share",
                "any",
                "--image",
                "ongrid/dev:latest",
                "--idle-timeout",
                "2h",
                "--max-duration",
                "3d",
                "--reservation",
                "cms-school",
            ],
            answers: vec![Answer::with_status(
                "201 Created",
                &session_view(SessionState::Starting),
            )],
            sent: vec![Sent::new("POST", "/v1/sessions").json(&CreateSession {
                name: Some(SessionName::parse("train1").unwrap()),
                gpus: GpuRequest {
                    count: 2,
                    min_capability: Some(ComputeCapability::new(8, 0)),
                    min_memory: Some(MemorySize(40_000_000_000)),
                    sharing: Sharing::Any,
                },
                image: Some("ongrid/dev:latest".into()),
                idle_timeout_secs: Some(7200),
                max_duration_secs: Some(3 * 86_400),
                reservation: Some("cms-school".into()),
            })],
            stdout: "name:       train1\nowner:      /DC=org/O=Example/CN=Alice Smith (alice-smith)\nstate:      STARTING\n",
        },
        Case {
            args: &["session", "new", "--wait", "--json"],
            answers: vec![
                Answer::with_status("201 Created", &pending_view(1)),
                Answer::ok(&session_view(SessionState::Waiting)),
            ],
            sent: vec![
                Sent::new("POST", "/v1/sessions").json(&CreateSession {
                    name: None,
                    gpus: GpuRequest::default(),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                    reservation: None,
                }),
                // The wait is the manager's: one long-poll for the states that end it.
                Sent::new(
                    "GET",
                    "/v1/sessions/train1?wait_for=WAITING%2CCONNECTED%2CIDLE%2CFAILED%2CHELD%2CENDED&timeout=20",
                ),
            ],
            stdout: "",
        },
        Case {
            args: &["session", "ls", "--all"],
            answers: vec![Answer::ok(&[session_view(SessionState::Waiting), pending_view(2)])],
            sent: vec![Sent::new("GET", "/v1/sessions?all=true")],
            stdout: "NAME    STATE                  NODE   GPUS  CREATED               OWNER                             REASON\n\
                     train1  WAITING                node1  1     2026-11-21 10:00:03Z  /DC=org/O=Example/CN=Alice Smith  placed on node1\n\
                     train1  PENDING (#2 in queue)  -      1     2026-11-21 10:00:03Z  /DC=org/O=Example/CN=Alice Smith  created\n",
        },
        Case {
            args: &["session", "ls", "--json"],
            answers: vec![Answer::ok(&[session_view(SessionState::Waiting)])],
            sent: vec![Sent::new("GET", "/v1/sessions")],
            stdout: "",
        },
        Case {
            args: &["session", "show", "train1", "--owner", ALICE],
            answers: vec![Answer::ok(&session_view(SessionState::Idle))],
            sent: vec![Sent::new("GET", &format!("/v1/sessions/train1?{OWNER_QUERY}"))],
            stdout: "transitions:\n  2026-11-21 10:00:03Z    → PENDING  created\n",
        },
        Case {
            args: &["session", "rm", "train1"],
            answers: vec![Answer::ok(&session_view(SessionState::Ended))],
            sent: vec![Sent::new("DELETE", "/v1/sessions/train1")],
            stdout: "session train1 removed (ENDED)\n",
        },
        Case {
            args: &["session", "hold", "train1", "--owner", ALICE, "--reason", "GPU maintenance"],
            answers: vec![Answer::ok(&session_view(SessionState::Held))],
            sent: vec![
                Sent::new("POST", &format!("/v1/sessions/train1/hold?{OWNER_QUERY}")).json(
                    &HoldRequest {
                        reason: Some("GPU maintenance".into()),
                    },
                ),
            ],
            stdout: "session train1 is HELD: its GPUs are free for others, its files are kept; \
                     bring it back with `devctl session release train1`\n",
        },
        Case {
            args: &["session", "hold", "train1"],
            answers: vec![Answer::ok(&session_view(SessionState::Held))],
            sent: vec![Sent::new("POST", "/v1/sessions/train1/hold")
                .json(&HoldRequest { reason: None })],
            stdout: "session train1 is HELD",
        },
        Case {
            args: &["session", "release", "train1"],
            answers: vec![Answer::ok(&SessionView {
                node: Some(NodeName::parse("node1").unwrap()),
                ..pending_view(1)
            })],
            sent: vec![Sent::new("POST", "/v1/sessions/train1/release")],
            stdout: "session train1 released: PENDING at position 1 in the queue; it restarts in \
                     its container on node1 once the scheduler gives it a GPU there (devctl \
                     session show train1)\n",
        },
        Case {
            args: &["session", "keep", "train1", "--for", "4h", "--json"],
            answers: vec![Answer::ok(&session_view(SessionState::Idle))],
            sent: vec![Sent::new("POST", "/v1/sessions/train1/keep").json(&KeepRequest {
                duration_secs: 4 * 3600,
            })],
            stdout: "",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

#[tokio::test]
async fn a_queued_session_is_noted_on_stderr() {
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![Answer::with_status("201 Created", &pending_view(3))],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["session", "new", "--json"],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(
        stderr(&output),
        "not placed yet: queued at position 3; it starts once the scheduler gives it a GPU \
         (devctl session show train1)\n"
    );
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["queue_position"], 3);
}

/// `devctl session web`: the session is read first, then a login link is asked for with the
/// app's page as `next`; the link goes to stdout, how long it works and the app's own address
/// to stderr, and the link to `$BROWSER` unless `--no-open`. A session that does not run is
/// refused before any link is made.
#[tokio::test]
async fn session_web_prints_and_opens_a_login_link_to_the_app() {
    const LINK: &str = "/dashboard/login?token=abc&next=/dashboard/sessions/train1/apps/";
    let ca = Ca::new("Site CA");
    let dir = tempfile::tempdir().unwrap();
    let opened = dir.path().join("opened");
    let browser = dir.path().join("browser");
    std::fs::write(
        &browser,
        format!("#!/bin/sh\nprintf '%s' \"$1\" > '{}'\n", opened.display()),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&browser, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let link = |app: &str| {
        Answer::with_status(
            "201 Created",
            &DashboardLink {
                path: format!("{LINK}{app}"),
                expires_at: chrono::Utc::now() + chrono::TimeDelta::minutes(5),
            },
        )
    };
    let asked = |app: &str| {
        vec![
            Sent::new("GET", "/v1/sessions/train1"),
            Sent::new("POST", "/v1/dashboard/links").json(&DashboardLinkRequest {
                next: Some(format!("/dashboard/sessions/train1/apps/{app}")),
            }),
        ]
    };
    for (args, app, opens) in [
        (&["session", "web", "train1"][..], "jupyter/", true),
        (
            &["session", "web", "train1", "--port", "8080"][..],
            "port/8080/",
            true,
        ),
        (
            &["session", "web", "train1", "--no-open"][..],
            "jupyter/",
            false,
        ),
    ] {
        let _ = std::fs::remove_file(&opened);
        let manager = FakeManager::start(
            &ca,
            &ca,
            vec![Answer::ok(&session_view(SessionState::Idle)), link(app)],
        )
        .await;
        let files = UserFiles::new(&ca, &ca);
        let mut env = files.env(&manager.url);
        env.push(("BROWSER", browser.display().to_string()));
        let output = devctl(files.home.path(), &env, args).await;
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {err}");
        assert_eq!(manager.sent(), asked(app), "{args:?}");
        let url = format!("{}{LINK}{app}", manager.url);
        assert_eq!(stdout(&output), format!("{url}\n"), "{args:?}");
        assert!(err.contains("it works once, for 4m "), "{args:?}: {err}");
        assert!(
            err.contains(&format!(
                "a browser logged in to the dashboard already can open {}/dashboard/sessions/\
                 train1/apps/{app} directly",
                manager.url
            )),
            "{args:?}: {err}"
        );
        assert!(!err.contains("warning"), "{args:?}: {err}");
        if opens {
            assert_eq!(std::fs::read_to_string(&opened).unwrap(), url, "{args:?}");
        } else {
            assert!(!opened.exists(), "{args:?} opened a browser");
        }
    }

    // A HELD session: its reason and the fix, and no link.
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![Answer::ok(&SessionView {
            reason: "idle for 2h".into(),
            ..session_view(SessionState::Held)
        })],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["session", "web", "train1"],
    )
    .await;
    assert_eq!(
        one_line_error(&output),
        "error: session train1 is HELD (idle for 2h): run `devctl session release train1` first"
    );
    assert_eq!(
        manager.sent(),
        vec![Sent::new("GET", "/v1/sessions/train1")]
    );
    assert_eq!(stdout(&output), "");

    // A browser that fails is a warning: the link is printed all the same.
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![
            Answer::ok(&session_view(SessionState::Waiting)),
            link("jupyter/"),
        ],
    )
    .await;
    let mut env = files.env(&manager.url);
    env.push(("BROWSER", "/nonexistent/browser".to_owned()));
    let output = devctl(files.home.path(), &env, &["session", "web", "train1"]).await;
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(stdout(&output).contains(LINK), "{}", stdout(&output));
    assert!(
        err.contains("warning: could not open a browser ($BROWSER /nonexistent/browser: "),
        "{err}"
    );
}

#[tokio::test]
async fn gpu_key_and_admin_commands_send_their_routes_and_bodies() {
    let cases = vec![
        Case {
            args: &["gpus"],
            answers: vec![Answer::ok(&[node_view(1, 0, None)])],
            sent: vec![Sent::new("GET", "/v1/nodes")],
            stdout: "NODE   GPU                                       MODEL                  CC   MEMORY    MODE       USED/CAP  FREE  HEALTH  SESSIONS\n\
                     node1  GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  1/1       0     ok      train1\n",
        },
        Case {
            args: &["admin", "gpu", "mode", UUID_A, "shared:4"],
            answers: vec![Answer::ok(&gpu_view(GpuMode::Shared { max_sessions: 4 }))],
            sent: vec![Sent::new("PUT", &format!("/v1/gpus/{UUID_A}/mode")).json(&SetGpuMode {
                mode: GpuMode::Shared { max_sessions: 4 },
            })],
            stdout: "GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f on node1 is now shared:4 (1 of 4 in use)\n",
        },
        Case {
            args: &["key", "ls", "--all"],
            answers: vec![Answer::ok(&[key_view()])],
            sent: vec![Sent::new("GET", "/v1/keys?all=true")],
            stdout: "SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  ssh-ed25519  alice@laptop  /DC=org/O=Example/CN=Alice Smith  2026-11-21 10:00:00Z  2026-11-22 10:00:00Z",
        },
        Case {
            args: &["key", "rm", FINGERPRINT],
            answers: vec![Answer::ok(&key_view())],
            sent: vec![Sent::new(
                "DELETE",
                "/v1/keys?fingerprint=SHA256%3AJHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI",
            )],
            stdout: "key SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI (ssh-ed25519, alice@laptop) removed\n",
        },
        Case {
            args: &["admin", "institute", "add", "local", "127.0.0.0/8", "::1/128"],
            answers: vec![Answer::with_status("201 Created", &institute_view())],
            sent: vec![Sent::new("POST", "/v1/institutes").json(&institute_view())],
            stdout: "institute local added: 127.0.0.0/8, ::1/128\n",
        },
        Case {
            args: &["admin", "institute", "ls"],
            answers: vec![Answer::ok(&[institute_view()])],
            sent: vec![Sent::new("GET", "/v1/institutes")],
            stdout: "NAME   NETWORKS\nlocal  127.0.0.0/8, ::1/128\n",
        },
        Case {
            args: &["admin", "institute", "show", "local", "--json"],
            answers: vec![Answer::ok(&institute_view())],
            sent: vec![Sent::new("GET", "/v1/institutes/local")],
            stdout: "",
        },
        Case {
            args: &["admin", "institute", "rm", "local"],
            answers: vec![Answer::ok(&institute_view())],
            sent: vec![Sent::new("DELETE", "/v1/institutes/local")],
            stdout: "institute local removed: 127.0.0.0/8, ::1/128 no longer allowed\n",
        },
        Case {
            args: &["admin", "audit", "--user", ALICE, "--since", "2026-11-21T10:00:00Z"],
            answers: vec![Answer::ok(&[audit_record()])],
            sent: vec![Sent::new(
                "GET",
                "/v1/audit?user=%2FDC%3Dorg%2FO%3DExample%2FCN%3DAlice+Smith&since=2026-11-21T10%3A00%3A00Z",
            )],
            stdout: "2026-11-21 10:01:00Z  open    /DC=org/O=Example/CN=Alice Smith  SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI  192.0.2.7  local      train1   1.5 KiB  0 B\n",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

#[tokio::test]
async fn node_and_gpu_operations_send_their_routes_and_bodies() {
    let cases = vec![
        Case {
            args: &["admin", "node", "ls"],
            answers: vec![Answer::ok(&[node_view(1, 2, drain("new PSU"))])],
            sent: vec![Sent::new("GET", "/v1/nodes")],
            stdout: "NODE   STATE            GPUS  SESSIONS  JOBS  BACKEND    AGENT  LAST SEEN\n\
                     node1  online, drained  1     1         2     simulated  0.1.0  2026-11-21 10:00:00Z\n\
                     node1: drained 2026-11-21 10:00 UTC by alice: new PSU\n",
        },
        Case {
            args: &["admin", "node", "drain", "node1", "--reason", "new PSU"],
            answers: vec![Answer::ok(&node_view(1, 0, drain("new PSU")))],
            sent: vec![
                Sent::new("POST", "/v1/nodes/node1/drain").json(&DrainRequest {
                    reason: Some("new PSU".into()),
                }),
            ],
            stdout: "node node1 drained 2026-11-21 10:00 UTC by alice: new PSU; 1 session keeps \
                     running there\n",
        },
        Case {
            args: &["admin", "node", "drain", "node1", "--wait", "--timeout", "10m"],
            answers: vec![
                Answer::ok(&node_view(2, 1, drain("maintenance"))),
                Answer::ok(&node_view(1, 0, drain("maintenance"))),
                Answer::ok(&node_view(0, 0, drain("maintenance"))),
            ],
            sent: vec![
                Sent::new("POST", "/v1/nodes/node1/drain").json(&DrainRequest { reason: None }),
                Sent::new("GET", "/v1/nodes/node1?wait_empty=true&timeout=60"),
                Sent::new("GET", "/v1/nodes/node1?wait_empty=true&timeout=60"),
            ],
            stdout: "node node1 drained 2026-11-21 10:00 UTC by alice: maintenance; nothing runs \
                     there\n",
        },
        Case {
            args: &["admin", "node", "undrain", "node1"],
            answers: vec![Answer::ok(&node_view(1, 0, None))],
            sent: vec![Sent::new("DELETE", "/v1/nodes/node1/drain")],
            stdout: "node node1 is back in service\n",
        },
        Case {
            args: &["admin", "node", "rm", "node1", "--json"],
            answers: vec![Answer::ok(&node_view(0, 0, None))],
            sent: vec![Sent::new("DELETE", "/v1/nodes/node1")],
            stdout: "",
        },
        Case {
            args: &["admin", "gpu", "drain", UUID_A, "--reason", "fan noise"],
            answers: vec![Answer::ok(&GpuView {
                drain: drain("fan noise"),
                ..gpu_view(GpuMode::Exclusive)
            })],
            sent: vec![
                Sent::new("POST", &format!("/v1/gpus/{UUID_A}/drain")).json(&DrainRequest {
                    reason: Some("fan noise".into()),
                }),
            ],
            stdout: "GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f on node1 drained 2026-11-21 \
                     10:00 UTC by alice: fan noise; 1 session or job keeps running on it\n",
        },
        Case {
            args: &["admin", "gpu", "undrain", UUID_A],
            answers: vec![Answer::ok(&gpu_view(GpuMode::Exclusive))],
            sent: vec![Sent::new("DELETE", &format!("/v1/gpus/{UUID_A}/drain"))],
            stdout: "GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f on node1 is back in service\n",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

#[tokio::test]
async fn key_add_of_a_known_key_says_it_was_renewed() {
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(&ca, &ca, vec![Answer::ok(&key_view())]).await;
    let files = UserFiles::new(&ca, &ca);
    let file = files.home.path().join("laptop.pub");
    std::fs::write(&file, format!("  {ED25519_KEY}  \n")).unwrap();
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["key", "add", file.to_str().unwrap()],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stdout(&output).contains("(ssh-ed25519, alice@laptop) was already yours: renewed\n"),
        "{}",
        stdout(&output)
    );
    assert_eq!(
        manager.sent(),
        [Sent::new("POST", "/v1/keys").json(&AddKey {
            public_key: ED25519_KEY.to_owned()
        })]
    );
}

#[tokio::test]
async fn image_commands_send_their_routes_and_bodies() {
    let create = |force: bool, compression: Compression| CreateImage {
        session: SessionName::parse("train1").unwrap(),
        reference: ImageReference::parse("mymodel:v1").unwrap(),
        force,
        compression,
    };
    let cases = vec![
        Case {
            args: &["freeze", "train1", "--tag", "mymodel:v1", "--no-wait"],
            answers: vec![Answer::with_status(
                "201 Created",
                &image_view(ImageState::Building),
            )],
            sent: vec![Sent::new("POST", "/v1/images").json(&create(false, Compression::Gzip))],
            stdout: "freezing session train1 to mymodel:v1 on node1 (BUILDING): follow it with \
                     `devctl image show mymodel:v1`\n",
        },
        Case {
            args: &[
                "freeze",
                "train1",
                "--tag",
                "mymodel:v1",
                "--force",
                "--compression",
                "zstd",
            ],
            answers: vec![
                Answer::with_status("201 Created", &image_view(ImageState::Building)),
                Answer::ok(&image_view(ImageState::Ready)),
            ],
            // The manager waits: the request names the progress devctl has (none yet).
            sent: vec![
                Sent::new("POST", "/v1/images").json(&create(true, Compression::Zstd)),
                Sent::new("GET", "/v1/images/mymodel:v1?after=0%2F0&timeout=20"),
            ],
            stdout: "image mymodel:v1 is READY\n  SIF:          /images/sha256/98fbda8214f8eb5cf69a46a4e0318c561d172754e49e6d6e3ac8d585285e0229.sif\n  digest:       sha256:98fbda8214f8eb5cf69a46a4e0318c561d172754e49e6d6e3ac8d585285e0229\n  size:         79.2 MiB\n  Docker image: ongrid/alice-smith/mymodel:v1 (on node node1)\n",
        },
        Case {
            args: &["image", "ls", "--all"],
            answers: vec![Answer::ok(&[image_view(ImageState::Ready)])],
            sent: vec![Sent::new("GET", "/v1/images?all=true")],
            stdout: "IMAGE       STATE  SIZE      DIGEST               SESSION  CREATED               OWNER\n\
                     mymodel:v1  READY  79.2 MiB  sha256:98fbda8214f8  train1   2026-11-22 00:33:56Z  /DC=org/O=Example/CN=Alice Smith\n",
        },
        Case {
            args: &["image", "show", DIGEST, "--owner", ALICE],
            answers: vec![Answer::ok(&image_view(ImageState::Ready))],
            sent: vec![Sent::new("GET", &format!("/v1/images/{DIGEST}?{OWNER_QUERY}"))],
            stdout: "image:         mymodel:v1\nstate:         READY\n",
        },
        Case {
            args: &["image", "rm", "mymodel:v1", "--json"],
            answers: vec![Answer::ok(&image_view(ImageState::Deleted))],
            sent: vec![Sent::new("DELETE", "/v1/images/mymodel:v1")],
            stdout: "",
        },
        Case {
            args: &["image", "share", "mymodel:v1"],
            answers: vec![Answer::ok(&ImageView {
                shared: true,
                ..image_view(ImageState::Ready)
            })],
            sent: vec![Sent::new("POST", "/v1/images/mymodel:v1/share")],
            stdout: "image mymodel:v1 is shared: anyone may run it as alice-smith/mymodel:v1 or \
                     sha256:98fbda8214f8eb5cf69a46a4e0318c561d172754e49e6d6e3ac8d585285e0229\n",
        },
        Case {
            args: &["image", "unshare", "alice-smith/mymodel:v1"],
            answers: vec![Answer::ok(&image_view(ImageState::Ready))],
            sent: vec![Sent::new(
                "POST",
                "/v1/images/alice-smith%2Fmymodel:v1/unshare",
            )],
            stdout: "image mymodel:v1 is private: only you may run it\n",
        },
        Case {
            args: &["image", "ls", "--shared"],
            answers: vec![Answer::ok(&[ImageView {
                shared: true,
                ..image_view(ImageState::Ready)
            }])],
            sent: vec![Sent::new("GET", "/v1/images?shared=true")],
            stdout: "IMAGE                   STATE  SIZE      DIGEST               SESSION  CREATED\n\
                     alice-smith/mymodel:v1  READY  79.2 MiB  sha256:98fbda8214f8  train1   2026-11-22 00:33:56Z\n",
        },
        Case {
            args: &["image", "show", "alice-smith/mymodel:v1"],
            answers: vec![Answer::ok(&ImageView {
                shared: true,
                ..image_view(ImageState::Ready)
            })],
            sent: vec![Sent::new("GET", "/v1/images/alice-smith%2Fmymodel:v1")],
            stdout: "image:         mymodel:v1\nstate:         READY\nshared:        anyone may run \
                     it as alice-smith/mymodel:v1\n",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

#[tokio::test]
async fn a_failed_freeze_says_why_and_shows_its_progress_on_stderr() {
    let ca = Ca::new("Site CA");
    let failed = ImageView {
        reason: "image store /images is full: free space or ask the admin".into(),
        progress: None,
        ..image_view(ImageState::Failed)
    };
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![
            Answer::with_status("201 Created", &image_view(ImageState::Building)),
            Answer::ok(&ImageView {
                progress: Some(ImageProgress {
                    bytes_done: 50 << 20,
                    bytes_total: 100 << 20,
                }),
                ..image_view(ImageState::Building)
            }),
            Answer::ok(&failed),
        ],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["freeze", "train1", "--tag", "mymodel:v1"],
    )
    .await;
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines[0],
        "freezing session train1 to mymodel:v1 on node1 (interrupting devctl does not stop the \
         freeze)"
    );
    // Not a terminal: a plain line (the second poll comes within 5 s, so only one).
    assert!(
        lines[1].starts_with("[###############---------------]  50%  50.0 MiB / 100.0 MiB"),
        "{err}"
    );
    assert_eq!(
        lines[2..],
        [
            "error: freezing session train1 to mymodel:v1 failed (FAILED): image store /images is \
          full: free space or ask the admin"
        ]
    );
    // Each wait names the progress shown so far; no request is repeated unchanged.
    let targets: Vec<(&str, String)> = manager
        .sent()
        .into_iter()
        .map(|sent| (sent.method, sent.target))
        .collect();
    assert_eq!(
        targets,
        [
            ("POST", "/v1/images".to_owned()),
            (
                "GET",
                "/v1/images/mymodel:v1?after=0%2F0&timeout=20".to_owned()
            ),
            (
                "GET",
                "/v1/images/mymodel:v1?after=52428800%2F104857600&timeout=20".to_owned()
            ),
        ]
    );
}

const JOB_ID: &str = "5d2c1f3e-8a4b-4c6d-9e0f-1a2b3c4d5e6f";

fn job_spec() -> ongrid_core::job::JobSpec {
    ongrid_core::job::JobSpecFile {
        image: Some("mymodel:v1".into()),
        command: vec![
            "python".into(),
            "train.py".into(),
            "--epochs".into(),
            "3".into(),
        ],
        gpus: Some(2),
        min_capability: Some("8.0".into()),
        share: Some("any".into()),
        cpus: Some(ongrid_core::job::CpuNumber::Fraction(1.5)),
        memory: Some("16G".into()),
        max_duration: Some("8h".into()),
        min_duration: Some("1h".into()),
        restartable: true,
        bucket: Some("sweep:2".into()),
        env: [("EPOCHS".to_owned(), "3".to_owned())].into(),
        home: true,
        ..Default::default()
    }
    .validate(time("2026-11-22T00:00:00Z"))
    .unwrap()
}

fn job_view(state: ongrid_core::job::JobState) -> ongrid_core::job::JobView {
    use ongrid_core::job::{JobId, JobLifecycle, JobReason, RestartChain};
    let id: JobId = JOB_ID.parse().unwrap();
    let lifecycle = JobLifecycle::new(time("2026-11-22T00:40:00Z"), JobReason::Submitted);
    ongrid_core::job::JobView {
        id,
        owner: Dn::parse(ALICE).unwrap(),
        user_name: UserName::parse("alice-smith").unwrap(),
        state,
        reason: "submitted".into(),
        spec: job_spec(),
        max_duration: Some("8h".parse().unwrap()),
        image_digest: Some(DIGEST.to_owned()),
        node: None,
        gpus: vec![],
        chain: RestartChain::first(id),
        previous_job: None,
        next_job: None,
        exit_code: None,
        queued_at: time("2026-11-22T00:40:00Z"),
        started_at: None,
        finished_at: None,
        queue_position: Some(1),
        waiting: None,
        transitions: lifecycle.history().to_vec(),
        grid: None,
        output_complete: false,
    }
}

#[tokio::test]
async fn job_commands_send_their_routes_and_bodies() {
    use ongrid_core::job::{JobState, LogChunk, SubmitJob};
    let queued = job_view(JobState::Queued);
    let cases = vec![
        Case {
            args: &[
                "job",
                "submit",
                "--image",
                "mymodel:v1",
                "--gpus",
                "2",
                "--min-capability",
                "8.0",
                "--share",
                "any",
                "--cpus",
                "1.5",
                "--memory",
                "16G",
                "--max-duration",
                "8h",
                "--min-duration",
                "1h",
                "--restartable",
                "--bucket",
                "sweep:2",
                "--env",
                "EPOCHS=3",
                "--home",
                "--reservation",
                "cms-school",
                "--",
                "python",
                "train.py",
                "--epochs",
                "3",
            ],
            answers: vec![Answer::with_status("201 Created", &queued)],
            sent: vec![Sent::new("POST", "/v1/jobs").json(&SubmitJob {
                spec: job_spec(),
                reservation: Some("cms-school".into()),
            })],
            stdout: "job 5d2c1f3e-8a4b-4c6d-9e0f-1a2b3c4d5e6f submitted (QUEUED)",
        },
        Case {
            args: &["job", "ls"],
            answers: vec![Answer::ok(&vec![queued.clone()])],
            sent: vec![Sent::new("GET", "/v1/jobs")],
            stdout: "QUEUED #1",
        },
        Case {
            args: &["job", "ls", "--all", "--json"],
            answers: vec![Answer::ok(&vec![queued.clone()])],
            sent: vec![Sent::new("GET", "/v1/jobs?all=true")],
            stdout: "",
        },
        Case {
            args: &["job", "show", JOB_ID],
            answers: vec![Answer::ok(&queued)],
            sent: vec![Sent::new("GET", &format!("/v1/jobs/{JOB_ID}"))],
            stdout: "command:       python train.py --epochs 3\n",
        },
        Case {
            args: &["job", "cancel", JOB_ID],
            answers: vec![Answer::ok(&job_view(JobState::Cancelled))],
            sent: vec![Sent::new("POST", &format!("/v1/jobs/{JOB_ID}/cancel"))],
            stdout: "is CANCELLED",
        },
        Case {
            args: &["job", "rm", JOB_ID],
            answers: vec![Answer::ok(&job_view(JobState::Cancelled))],
            sent: vec![Sent::new("DELETE", &format!("/v1/jobs/{JOB_ID}"))],
            stdout:
                "job 5d2c1f3e-8a4b-4c6d-9e0f-1a2b3c4d5e6f removed (CANCELLED), with its output\n",
        },
        Case {
            args: &["job", "halt", JOB_ID, "--json"],
            answers: vec![Answer::ok(&job_view(JobState::MustHalt))],
            sent: vec![Sent::new("POST", &format!("/v1/jobs/{JOB_ID}/halt"))],
            stdout: "",
        },
        Case {
            args: &["job", "logs", "-f", JOB_ID],
            // The first request answers at once; then the manager waits for more, and a wait
            // that ends without output (its timeout) is asked again from the same offset.
            answers: vec![
                Answer::ok(&LogChunk {
                    offset: 0,
                    data: b"epoch 1\n".to_vec(),
                    complete: false,
                }),
                Answer::ok(&LogChunk {
                    offset: 8,
                    data: Vec::new(),
                    complete: false,
                }),
                Answer::ok(&LogChunk {
                    offset: 8,
                    data: b"epoch 2\n".to_vec(),
                    complete: true,
                }),
            ],
            sent: vec![
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}/logs?offset=0")),
                Sent::new(
                    "GET",
                    &format!("/v1/jobs/{JOB_ID}/logs?offset=8&wait=true&timeout=20"),
                ),
                Sent::new(
                    "GET",
                    &format!("/v1/jobs/{JOB_ID}/logs?offset=8&wait=true&timeout=20"),
                ),
            ],
            stdout: "epoch 1\nepoch 2\n",
        },
        Case {
            // Without -f: what is stored now, asked for until an answer brings nothing more;
            // the job still runs, so that is all there is.
            args: &["job", "logs", JOB_ID],
            answers: vec![
                Answer::ok(&LogChunk {
                    offset: 0,
                    data: b"epoch 1\n".to_vec(),
                    complete: false,
                }),
                Answer::ok(&LogChunk {
                    offset: 8,
                    data: Vec::new(),
                    complete: false,
                }),
                Answer::ok(&job_view(JobState::Running)),
            ],
            sent: vec![
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}/logs?offset=0")),
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}/logs?offset=8")),
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}")),
            ],
            stdout: "epoch 1\n",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

/// `job logs` without -f on a job that has ended but whose output is not all in waits for the
/// rest on the manager's long-poll, saying so on stderr, and says when the rest never came.
#[tokio::test]
async fn job_logs_waits_for_the_rest_of_an_ended_jobs_output() {
    use ongrid_core::job::{JobState, LogChunk};
    let chunk = |offset: u64, data: &[u8], complete: bool| {
        Answer::ok(&LogChunk {
            offset,
            data: data.to_vec(),
            complete,
        })
    };
    for node_sent_all in [true, false] {
        let ended = job_view(JobState::Finished);
        let mut after = ended.clone();
        after.output_complete = node_sent_all;
        let answers = vec![
            chunk(0, b"epoch 1\n", false),
            chunk(8, b"", false),
            Answer::ok(&ended),
            chunk(8, b"done\n", true),
            Answer::ok(&after),
        ];
        let ca = Ca::new("Site CA");
        let manager = FakeManager::start(&ca, &ca, answers).await;
        let files = UserFiles::new(&ca, &ca);
        let run = devctl(
            files.home.path(),
            &files.env(&manager.url),
            &["job", "logs", JOB_ID],
        )
        .await;
        assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
        assert_eq!(
            manager.sent(),
            [
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}/logs?offset=0")),
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}/logs?offset=8")),
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}")),
                Sent::new(
                    "GET",
                    &format!("/v1/jobs/{JOB_ID}/logs?offset=8&wait=true&timeout=20"),
                ),
                Sent::new("GET", &format!("/v1/jobs/{JOB_ID}")),
            ]
        );
        assert_eq!(stdout(&run), "epoch 1\ndone\n");
        let notes = stderr(&run);
        assert!(notes.contains("has ended; waiting for the rest"), "{notes}");
        assert_eq!(
            notes.contains("never came from its node"),
            !node_sent_all,
            "{notes}"
        );
    }
}

/// `job rm A B`: each job in turn; a refused one is named with the manager's words on stderr,
/// the others are removed, and the command fails saying how many were not.
#[tokio::test]
async fn job_rm_removes_what_it_may_and_names_each_refusal() {
    use ongrid_core::job::JobState;
    const RUNNING_ID: &str = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let refusal = format!(
        "job {RUNNING_ID} is RUNNING and has not ended: cancel it first with `devctl job cancel \
         {RUNNING_ID}`, then remove it"
    );
    let ca = Ca::new("Site CA");
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![
            Answer::error("409 Conflict", "conflict", &refusal),
            Answer::ok(&job_view(JobState::Finished)),
        ],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["job", "rm", RUNNING_ID, JOB_ID],
    )
    .await;
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert_eq!(
        stdout(&output),
        format!("job {JOB_ID} removed (FINISHED), with its output\n")
    );
    assert_eq!(
        stderr(&output),
        format!("job {RUNNING_ID}: {refusal}\nerror: 1 of 2 jobs not removed (above)\n")
    );
    assert_eq!(
        manager.sent(),
        [
            Sent::new("DELETE", &format!("/v1/jobs/{RUNNING_ID}")),
            Sent::new("DELETE", &format!("/v1/jobs/{JOB_ID}")),
        ]
    );
}

/// `job logs` without -f prints the whole stored output, however many 1 MiB answers it takes:
/// of a running job until an answer brings nothing more, of an ended one until it is complete.
#[tokio::test]
async fn job_logs_prints_all_of_an_output_over_one_answer() {
    use ongrid_core::job::LogChunk;
    const MIB: usize = 1024 * 1024;
    let output: Vec<u8> = (0..)
        .flat_map(|n: u32| format!("step {n:07}\n").into_bytes())
        .take(MIB + MIB / 2 + 7)
        .collect();
    let chunk = |from: usize, to: usize, complete: bool| {
        Answer::ok(&LogChunk {
            offset: from as u64,
            data: output[from..to].to_vec(),
            complete,
        })
    };
    let asked = |offsets: &[usize]| -> Vec<Sent> {
        offsets
            .iter()
            .map(|o| Sent::new("GET", &format!("/v1/jobs/{JOB_ID}/logs?offset={o}")))
            .collect()
    };
    let end = output.len();
    for (answers, sent) in [
        // Running: the stored output in two answers, then nothing more (yet), and the job
        // still runs.
        (
            vec![
                chunk(0, MIB, false),
                chunk(MIB, end, false),
                chunk(end, end, false),
                Answer::ok(&job_view(ongrid_core::job::JobState::Running)),
            ],
            [
                asked(&[0, MIB, end]),
                vec![Sent::new("GET", &format!("/v1/jobs/{JOB_ID}"))],
            ]
            .concat(),
        ),
        // Ended: the second answer says it is complete.
        (
            vec![chunk(0, MIB, false), chunk(MIB, end, true)],
            asked(&[0, MIB]),
        ),
    ] {
        let ca = Ca::new("Site CA");
        let manager = FakeManager::start(&ca, &ca, answers).await;
        let files = UserFiles::new(&ca, &ca);
        let run = devctl(
            files.home.path(),
            &files.env(&manager.url),
            &["job", "logs", JOB_ID],
        )
        .await;
        assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
        assert_eq!(manager.sent(), sent);
        assert_eq!(run.stdout.len(), output.len());
        assert!(run.stdout == output, "stdout is the whole output, in order");
        assert_eq!(stderr(&run), "");
    }
}

#[tokio::test]
async fn a_job_on_a_mig_device_is_submitted_with_mig_and_shows_its_slice() {
    use ongrid_core::job::{JobSpecFile, JobState, SubmitJob};
    let spec = JobSpecFile {
        image: Some("mymodel:v1".into()),
        command: vec!["python".into(), "train.py".into()],
        share: Some("mig:1g.10gb".into()),
        ..Default::default()
    }
    .validate(time("2026-11-22T00:00:00Z"))
    .unwrap();
    let mut running = job_view(JobState::Running);
    running.spec = spec.clone();
    running.queue_position = None;
    running.node = Some(ongrid_core::NodeName::parse("node1").unwrap());
    running.gpus =
        vec![ongrid_core::GpuId::parse("MIG-c7384736-a75d-5afc-978f-d2f1294409fd").unwrap()];
    let cases = vec![
        Case {
            args: &[
                "job",
                "submit",
                "--image",
                "mymodel:v1",
                "--mig",
                "1g.10gb",
                "--",
                "python",
                "train.py",
            ],
            answers: vec![Answer::with_status("201 Created", &running)],
            sent: vec![Sent::new("POST", "/v1/jobs").json(&SubmitJob {
                spec,
                reservation: None,
            })],
            stdout: "request:       1 MIG device, 1g.10gb or larger
\
                     node:          node1 (MIG-c7384736-a75d-5afc-978f-d2f1294409fd)
",
        },
        Case {
            args: &["job", "ls"],
            answers: vec![Answer::ok(&vec![running.clone()])],
            sent: vec![Sent::new("GET", "/v1/jobs")],
            stdout: "node1 (mig:1g.10gb)",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

fn user_view(removed: bool) -> ongrid_core::api::UserView {
    use ongrid_core::api::{UserAction, UserEvent, UserView};
    let at = chrono::DateTime::parse_from_rfc3339("2026-11-21T10:00:00Z")
        .unwrap()
        .into();
    let admin = Dn::parse("/DC=org/O=Example/CN=Site Admin").unwrap();
    UserView {
        dn: Dn::parse(ALICE).unwrap(),
        user_name: UserName::parse("alice-smith").unwrap(),
        uid: 20_000,
        removed_at: removed.then_some(at),
        removed_by: removed.then(|| admin.clone()),
        events: vec![UserEvent {
            at,
            action: UserAction::Removed,
            by: admin,
            details: "1 key(s) deleted, 1 session(s) ended, 0 job(s) cancelled, 1 image(s) \
                      removed"
                .to_owned(),
        }],
    }
}

#[tokio::test]
async fn user_commands_send_their_routes_and_bodies() {
    use ongrid_core::api::UserRemoved;
    const ALICE_SEGMENT: &str = "%2FDC%3Dorg%2FO%3DExample%2FCN%3DAlice%20Smith";
    let removed = UserRemoved {
        user: user_view(true),
        keys: vec!["SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI".to_owned()],
        sessions: vec![SessionName::parse("train1").unwrap()],
        jobs: Vec::new(),
        images: vec!["mymodel:v1".to_owned()],
    };
    let cases = vec![
        Case {
            args: &["admin", "user", "ls"],
            answers: vec![Answer::ok(&[user_view(true)])],
            sent: vec![Sent::new("GET", "/v1/users")],
            stdout: "alice-smith  20000  removed 2026-11-21 10:00:00Z by /DC=org/O=Example/CN=Site Admin",
        },
        Case {
            args: &["admin", "user", "rm", ALICE],
            answers: vec![Answer::ok(&removed)],
            sent: vec![Sent::new("DELETE", &format!("/v1/users/{ALICE_SEGMENT}"))],
            stdout: "user alice-smith removed (/DC=org/O=Example/CN=Alice Smith); the audit log \
                     keeps their name\n\
                     keys deleted:    SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI\n\
                     sessions ended:  train1\n\
                     jobs cancelled:  -\n\
                     images removed:  mymodel:v1\n",
        },
        Case {
            args: &["admin", "user", "rm", ALICE, "--force", "--json"],
            answers: vec![Answer::ok(&removed)],
            sent: vec![Sent::new(
                "DELETE",
                &format!("/v1/users/{ALICE_SEGMENT}?force=true"),
            )],
            stdout: "",
        },
        Case {
            args: &["admin", "user", "restore", ALICE],
            answers: vec![Answer::ok(&user_view(false))],
            sent: vec![Sent::new(
                "POST",
                &format!("/v1/users/{ALICE_SEGMENT}/restore"),
            )],
            stdout: "user alice-smith restored (/DC=org/O=Example/CN=Alice Smith): they may use \
                     ongrid again",
        },
    ];
    for case in cases {
        check(case).await;
    }
}

#[tokio::test]
async fn a_refused_user_removal_is_one_line_with_the_managers_words() {
    let ca = Ca::new("Site CA");
    let message = "/DC=org/O=Example/CN=Alice Smith still has session train1 (WAITING): end \
                   them first, or remove the user with --force, which ends their sessions and \
                   cancels their jobs";
    let manager = FakeManager::start(
        &ca,
        &ca,
        vec![Answer::error("409 Conflict", "conflict", message)],
    )
    .await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&manager.url),
        &["admin", "user", "rm", ALICE],
    )
    .await;
    let line = one_line_error(&output);
    assert!(line.contains(message), "{line}");
}

/// `devctl job ls`'s REASON column says why a QUEUED job waits, as squeue's NODELIST(REASON)
/// does: the local queue's words, or a grid job's engine reason in words (it said "submitted"
/// for a job waiting in Slurm's queue); an ended job keeps its last transition's reason.
#[test]
fn job_ls_says_why_a_queued_job_waits() {
    use devctl::job::catalog::render_jobs;
    use ongrid_core::job::{GridJobView, JobState, JobTarget};
    let mut local = job_view(JobState::Queued);
    local.waiting = Some("for a fitting GPU to be free".into());
    let mut slurm = job_view(JobState::Queued);
    slurm.queue_position = None;
    slurm.waiting =
        Some("waiting in Slurm: the GPUs (or CPUs, memory) it asks for are in use".into());
    slurm.grid = Some(GridJobView {
        target: JobTarget::Slurm,
        account: "alice".into(),
        engine_id: Some("42".into()),
        engine_state: Some("PENDING (Resources)".into()),
        polled_at: None,
    });
    let mut ended = job_view(JobState::Finished);
    ended.queue_position = None;
    ended.reason = "exited with code 0".into();
    let table = render_jobs(&[local, slurm, ended], false, Some(400));
    let reasons: Vec<&str> = table
        .lines()
        .skip(1)
        .map(|line| line.split("2026-11-22 00:40:00Z").nth(1).unwrap().trim())
        .collect();
    assert_eq!(
        reasons,
        [
            "waiting for a fitting GPU to be free",
            "waiting in Slurm: the GPUs (or CPUs, memory) it asks for are in use",
            "exited with code 0",
        ],
        "{table}"
    );
}
