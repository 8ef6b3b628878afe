//! A user with only a bearer token: the manager trusts a token issuer whose keys the site keeps
//! as a JWK set file (a site without outbound access); tokens minted here as that issuer would
//! (ES256, WLCG profile). devctl finds the token in `BEARER_TOKEN_FILE`, creates a session and
//! registers an SSH key with it, and `ssh` lands in the container as the token's user; a token
//! without `compute.create` is refused with the scope named; an admin links the token identity
//! to a certificate user, whose DN the token then acts as.

use std::path::{Path, PathBuf};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ongrid_e2e::{write_private, SimGpu, Site, User};
use serde_json::{json, Value};

const ISSUER: &str = "https://iam.e2e.test.invalid/";
const AUDIENCE: &str = "ongrid-e2e";
const SUBJECT: &str = "7d3f0c9e-e2e0-4a6b-9c1d-2b5a8f6e4d10";

/// The issuer's signing key and the JWK set file the site keeps of it.
struct TestIssuer {
    _dir: tempfile::TempDir,
    jwks: PathBuf,
    key: EncodingKey,
}

impl TestIssuer {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let pair = rcgen::KeyPair::generate().expect("a P-256 key");
        let key = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).expect("PEM key");
        let mut public = Jwk::from_encoding_key(&key, Algorithm::ES256).expect("its JWK");
        public.common.key_id = Some("e2e-1".to_owned());
        let jwks = dir.path().join("jwks.json");
        let set = JwkSet { keys: vec![public] };
        std::fs::write(&jwks, serde_json::to_vec(&set).expect("a JWK set as JSON"))
            .expect("write the JWK set");
        Self {
            _dir: dir,
            jwks,
            key,
        }
    }

    /// The manager's `[[token_issuers]]` for it.
    fn config(&self) -> String {
        format!(
            "[[token_issuers]]\nname = \"iam\"\nissuer = \"{ISSUER}\"\naudience = [\"{AUDIENCE}\"]\n\
             jwks_file = \"{}\"\n",
            self.jwks.display()
        )
    }

    /// A token of the test's subject with `scope`, valid for an hour, written to `path` (0600).
    fn token_file(&self, path: &Path, scope: &str) -> PathBuf {
        let now = chrono::Utc::now().timestamp();
        let claims: Value = json!({
            "iss": ISSUER,
            "sub": SUBJECT,
            "aud": AUDIENCE,
            "exp": now + 3600,
            "iat": now,
            "nbf": now,
            "wlcg.ver": "1.0",
            "scope": scope,
            "wlcg.groups": ["/cms"],
        });
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some("e2e-1".to_owned());
        let token = jsonwebtoken::encode(&header, &claims, &self.key).expect("sign the token");
        write_private(path, format!("{token}\n")).expect("write the token file");
        path.to_path_buf()
    }
}

fn devctl(site: &Site, user: &User, token: &Path, args: &[&str]) -> std::process::Output {
    site.devctl_env(user, &[("BEARER_TOKEN_FILE", token)], args)
}

fn ok(out: std::process::Output, site: &Site) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "status {}\nstdout: {text}\nstderr: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        site.logs()
    );
    text
}

#[test]
fn a_user_with_only_a_token_creates_a_session_registers_a_key_and_lands_over_ssh() {
    let issuer = TestIssuer::new();
    let mut site = Site::start_configured(&[SimGpu::a100(1)], &issuer.config(), "");
    site.allow_loopback();
    let user = site.token_user("Tina");
    let token = issuer.token_file(
        &site.dir.path().join("tina-token"),
        "compute.read compute.create compute.modify compute.cancel",
    );

    let whoami = ok(devctl(&site, &user, &token, &["whoami"]), &site);
    assert!(whoami.contains("bearer token"), "{whoami}");
    assert!(whoami.contains(SUBJECT), "{whoami}");
    assert!(whoami.contains(ISSUER), "{whoami}");

    ok(
        devctl(
            &site,
            &user,
            &token,
            &["session", "new", "--name", "tok1", "--wait"],
        ),
        &site,
    );
    let public = format!("{}.pub", user.ssh_key.display());
    ok(
        devctl(&site, &user, &token, &["key", "add", &public]),
        &site,
    );

    let me: Value = serde_json::from_str(&ok(
        devctl(&site, &user, &token, &["whoami", "--json"]),
        &site,
    ))
    .expect("whoami --json");
    let login = me["user_name"].as_str().expect("a login name").to_owned();
    assert_eq!(
        me["dn"].as_str(),
        Some(format!("/O=ongrid token/OU=iam/CN={SUBJECT}").as_str())
    );
    let out = site.ssh(&user, "tok1", "id -un", b"");
    assert!(
        out.status.success(),
        "ssh: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        site.logs()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), login);

    // A token that may only read cannot create.
    let reader = issuer.token_file(&site.dir.path().join("reader-token"), "compute.read");
    let out = devctl(&site, &user, &reader, &["session", "new", "--name", "tok2"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("lacks the scope compute.create"),
        "{stderr}"
    );
    ok(
        devctl(&site, &user, &token, &["session", "rm", "tok1"]),
        &site,
    );
    // An admin links the token identity to a certificate user's DN: the token then acts as
    // that user.
    let carl = site.user("Carl");
    site.devctl_ok(&carl, &["whoami"]);
    let linked = site.devctl_ok(
        &site.admin,
        &[
            "admin",
            "user",
            "link",
            "--issuer",
            "iam",
            "--subject",
            SUBJECT,
            &carl.creds.dn,
        ],
    );
    assert!(linked.contains(&carl.creds.dn), "{linked}");
    let links = site.devctl_ok(&site.admin, &["admin", "user", "links"]);
    assert!(links.contains(SUBJECT) && links.contains("iam"), "{links}");
    let me: Value = serde_json::from_str(&ok(
        devctl(&site, &user, &token, &["whoami", "--json"]),
        &site,
    ))
    .expect("whoami --json");
    assert_eq!(me["dn"].as_str(), Some(carl.creds.dn.as_str()));
    assert_eq!(me["credential"].as_str(), Some("token"));
    site.devctl_ok(
        &site.admin,
        &[
            "admin",
            "user",
            "unlink",
            "--issuer",
            "iam",
            "--subject",
            SUBJECT,
        ],
    );
}
