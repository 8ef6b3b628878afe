//! Runs the built `devctl` binary: help texts, refusal of bad arguments (exit 2, core's
//! message), and the one-line errors for missing credentials, an unreachable manager, a refused
//! client certificate and an untrusted server certificate. The TLS cases talk to a real rustls
//! server configured as the manager's is (client certificates required, verified against a CA
//! directory); the full API against the real manager is covered by the end-to-end suite.

// This file is all test code (`unwrap_used` is denied outside tests): a failed unwrap is a
// failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const DEVCTL: &str = env!("CARGO_BIN_EXE_devctl");
const DC: [u64; 7] = [0, 9, 2342, 19200300, 100, 1, 25];

/// Runs devctl with only the given environment (and `HOME` pointing at an empty directory, so
/// no user's config file is read).
async fn devctl(home: &Path, env: &[(&str, String)], args: &[&str]) -> Output {
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
        std::fs::write(&proxy, format!("{}{}", cert.pem(), key.serialize_pem())).unwrap();
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

/// A TLS server as the manager runs it: its certificate from `server_ca`, client certificates
/// required and verified against `client_ca`. It answers each connection whose handshake
/// succeeds with `response`. Returns the URL.
async fn tls_server(server_ca: &Ca, client_ca: &Ca, response: String) -> String {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(client_ca.cert.der().clone()).unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
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
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let response = response.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = tls.write_all(response.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    url
}

/// An HTTP/1.1 answer with a JSON body.
fn http_response(status: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn not_found() -> String {
    http_response(
        "404 Not Found",
        r#"{"error":{"code":"not_found","message":"no session train1: list yours with devctl session ls"}}"#,
    )
}

fn whoami() -> String {
    http_response(
        "200 OK",
        r#"{"dn":"/DC=org/O=Example/CN=Alice Smith","user_name":"alice-smith","uid":20000,"admin":true}"#,
    )
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
        (
            &["session", "--help"],
            &["Usage: devctl session", "new", "ls", "show", "rm"],
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
    let key_view = r#"{"fingerprint":"SHA256:JHi5mN1C3fT7x0PEZdm2b4t8YxvR6UfQxEp2xq2hFmI","algorithm":"ssh-ed25519","comment":"alice@laptop","owner":"/DC=org/O=Example/CN=Alice Smith","added_at":"2026-11-21T10:00:00Z","expires_at":"2026-11-22T10:00:00Z"}"#;
    let url = tls_server(&ca, &ca, http_response("201 Created", key_view)).await;
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
    std::fs::write(
        config_dir.join("devctl.toml"),
        format!(
            "manager_url = \"https://127.0.0.1:1\"\ncert = \"{}\"\nca_dir = \"{}\"\n",
            files.proxy.display(),
            files.ca_dir.display()
        ),
    )
    .unwrap();
    let output = devctl(files.home.path(), &[], &["session", "ls"]).await;
    assert!(
        one_line_error(&output)
            .starts_with("error: cannot reach the manager at https://127.0.0.1:1 "),
        "{}",
        stderr(&output)
    );
}

#[tokio::test]
async fn a_refused_certificate_is_named_by_its_dn() {
    let site_ca = Ca::new("Site CA");
    let stranger_ca = Ca::new("Stranger CA");
    // The manager trusts only the site CA for clients; Alice's certificate is from another.
    let url = tls_server(&site_ca, &site_ca, whoami()).await;
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
    let url = tls_server(&ca, &ca, whoami()).await;
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
    let url = tls_server(&other_ca, &site_ca, whoami()).await;
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
    let url = tls_server(&ca, &ca, not_found()).await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(
        files.home.path(),
        &files.env(&url),
        &["session", "show", "train1"],
    )
    .await;
    assert_eq!(
        one_line_error(&output),
        "error: no session train1: list yours with devctl session ls"
    );
}

#[tokio::test]
async fn an_accepted_certificate_gets_an_answer() {
    let ca = Ca::new("Site CA");
    let url = tls_server(&ca, &ca, whoami()).await;
    let files = UserFiles::new(&ca, &ca);
    let output = devctl(files.home.path(), &files.env(&url), &["whoami"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(
        stdout(&output),
        "dn:     /DC=org/O=Example/CN=Alice Smith\nlogin:  alice-smith\nuid:    20000\nadmin:  yes\n"
    );
    let output = devctl(files.home.path(), &files.env(&url), &["whoami", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["uid"], 20000);
}
