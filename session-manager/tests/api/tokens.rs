//! Bearer tokens over the API, from a token issuer the test runs on loopback: its OpenID
//! discovery document and JWK set served over https (a certificate of a CA the test makes,
//! named by the issuer's `ca_file`), keys made here, tokens minted with jsonwebtoken.
//! - a token-only user (no certificate) is known by issuer and subject, admitted by a token
//!   group, creates a session, registers an SSH key that expires with the token, and is refused
//!   what its scopes do not grant; once the token expired, the gateway refuses the key naming
//!   the token tools;
//! - every refusal (unknown issuer, another audience, signature, HMAC, expiry, missing group,
//!   no credential) says what is wrong and is logged without the token;
//! - the issuer rotates its keys: the new key is fetched through discovery, a made-up key does
//!   not make the manager fetch again within 30 s, a retired key is refused;
//! - an admin links a token identity to the user of a DN, and unlinks it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use axum::routing::get;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ongrid_core::api::{CredentialKind, KeyOwner, LinkToken, TokenLinkView};
use serde_json::{json, Value};

use super::*;

const AUDIENCE: &str = "https://ongrid.test.invalid:8443";
const SUBJECT: &str = "e1eb758b-b73c-4761-bfff-adc793da409c";

/// A P-256 signing key of the issuer, with its public JWK.
struct SigningKey {
    kid: String,
    private: EncodingKey,
    public: Jwk,
}

impl SigningKey {
    fn new(kid: &str) -> Self {
        let pair = KeyPair::generate().unwrap();
        let private = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
        let mut public = Jwk::from_encoding_key(&private, Algorithm::ES256).unwrap();
        public.common.key_id = Some(kid.to_owned());
        Self {
            kid: kid.to_owned(),
            private,
            public,
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.private).unwrap()
    }
}

/// The token issuer on loopback.
struct Issuer {
    /// `https://127.0.0.1:PORT/`, the `iss` of its tokens.
    url: String,
    /// Its CA certificate's file, the `ca_file` of the manager's config.
    ca_file: std::path::PathBuf,
    keys: Arc<Mutex<JwkSet>>,
    /// How many times the JWK set was fetched.
    fetches: Arc<AtomicUsize>,
    shutdown: CancellationToken,
}

impl Issuer {
    async fn start(dir: &Path, keys: &[&SigningKey]) -> Self {
        let ca = Ca::new("token issuer test CA");
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, "issuer");
        params.subject_alt_names = vec![SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST))];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
        let ca_file = dir.join("issuer-ca.pem");
        std::fs::write(&ca_file, ca.cert.pem()).unwrap();

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/", listener.local_addr().unwrap());
        let jwks = Arc::new(Mutex::new(JwkSet {
            keys: keys.iter().map(|key| key.public.clone()).collect(),
        }));
        let fetches = Arc::new(AtomicUsize::new(0));
        let document = json!({ "issuer": url, "jwks_uri": format!("{url}jwks") });
        let router = axum::Router::new()
            .route(
                "/.well-known/openid-configuration",
                get(move || {
                    let document = document.clone();
                    async move { axum::Json(document) }
                }),
            )
            .route(
                "/jwks",
                get({
                    let jwks = jwks.clone();
                    let fetches = fetches.clone();
                    move || {
                        fetches.fetch_add(1, Ordering::SeqCst);
                        let set = jwks.lock().unwrap().clone();
                        async move { axum::Json(set) }
                    }
                }),
            );
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = listener.accept() => accepted.unwrap(),
                };
                let acceptor = acceptor.clone();
                let router = router.clone();
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(stream).await else {
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(router);
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await
                        .ok();
                });
            }
        });
        Self {
            url,
            ca_file,
            keys: jwks,
            fetches,
            shutdown,
        }
    }

    /// Publishes `keys` instead of the ones it had.
    fn publish(&self, keys: &[&SigningKey]) {
        self.keys.lock().unwrap().keys = keys.iter().map(|key| key.public.clone()).collect();
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }

    /// The claims of a WLCG token of `sub` for this site, valid for an hour.
    fn claims(&self, sub: &str, groups: &[&str], scope: &str) -> Value {
        let now = Utc::now().timestamp();
        json!({
            "iss": self.url,
            "sub": sub,
            "aud": AUDIENCE,
            "exp": now + 3600,
            "iat": now - 5,
            "nbf": now - 5,
            "wlcg.ver": "1.0",
            "scope": scope,
            "wlcg.groups": groups,
        })
    }
}

impl Drop for Issuer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The test site, trusting `issuer` and admitting token group /cms (group `cms`) and Alice.
fn config(site: &Site, issuer: &Issuer) -> Config {
    let text = format!(
        "{}\n[policy]\nadmit = [\n{{ fqan = \"/cms\", group = \"cms\" }},\n{{ dn = \"{ALICE}\", group = \"staff\" }},\n]\n\n\
         [[token_issuers]]\nname = \"iam\"\nissuer = \"{}\"\naudience = [\"{AUDIENCE}\"]\n\
         ca_file = \"{}\"\n",
        std::fs::read_to_string(&site.config.path).unwrap(),
        issuer.url,
        path(&issuer.ca_file),
    );
    Config::from_toml(&text, &site.config.path, |_| None).unwrap()
}

/// A caller with no certificate and `token`.
fn bearer(site: &Site, m: &Running, token: &str) -> Api {
    Api::new(site.client(None), m.addr).with_token(token)
}

const ALL_BUT_CANCEL: &str = "compute.read compute.create compute.modify";

#[tokio::test]
async fn a_token_only_user_creates_a_session_and_an_ssh_key_that_expires_with_the_token() {
    let site = Site::new();
    let key = SigningKey::new("k1");
    let issuer = Issuer::start(site.dir.path(), &[&key]).await;
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(config(&site, &issuer), Some(clock.clone()))
        .await;
    m.node1.register("node1", vec![a100(1)]).await;

    let claims = issuer.claims(SUBJECT, &["/cms", "/cms/uscms"], ALL_BUT_CANCEL);
    let expires_at = DateTime::from_timestamp(claims["exp"].as_i64().unwrap(), 0).unwrap();
    let user = bearer(&site, &m, &key.sign(&claims));

    let me: WhoAmI = user.ok(StatusCode::OK, user.get("/v1/whoami")).await;
    let dn = format!("/O=ongrid token/OU=iam/CN={SUBJECT}");
    assert_eq!(me.dn.as_str(), dn);
    assert_eq!(me.credential, Some(CredentialKind::Token));
    assert_eq!(me.group.as_deref(), Some("cms"));
    assert_eq!(me.not_after, Some(expires_at));
    let token = me.token.expect("whoami says what the token is");
    assert_eq!(token.issuer, issuer.url);
    assert_eq!(token.subject, SUBJECT);
    assert_eq!(token.groups, ["/cms", "/cms/uscms"]);
    assert_eq!(
        token.scopes,
        ["compute.read", "compute.create", "compute.modify"]
    );

    let session = user.create(Some("train1"), one_gpu()).await;
    assert_eq!(session.owner.as_str(), dn);
    let added: KeyView = user
        .ok(StatusCode::CREATED, user.post("/v1/keys", &add_key(KEY_A)))
        .await;
    assert_eq!(added.expires_at, expires_at);
    let (status, body) = m.gateway.authorize(KEY_A).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let owner: KeyOwner = serde_json::from_str(&body).unwrap();
    assert_eq!(owner.owner.as_str(), dn);

    // compute.cancel was not granted: the session stays.
    let refused = user
        .fails(StatusCode::FORBIDDEN, user.delete("/v1/sessions/train1"))
        .await;
    assert!(
        refused
            .error
            .message
            .contains("lacks the scope compute.cancel")
            && refused.error.message.contains("oidc-token"),
        "{refused:?}"
    );
    user.show("train1").await;
    // Nor may it log into the dashboard, which does everything.
    let refused = user
        .fails(
            StatusCode::FORBIDDEN,
            user.post("/v1/dashboard/links", &json!({})),
        )
        .await;
    assert!(
        refused.error.message.contains("compute.cancel"),
        "{refused:?}"
    );

    // An hour and a minute later the token and the key have expired.
    clock.advance(TimeDelta::minutes(62));
    let refused = user
        .fails(StatusCode::UNAUTHORIZED, user.get("/v1/whoami"))
        .await;
    assert!(refused.error.message.contains("expired at"), "{refused:?}");
    let (status, body) = m.gateway.authorize(KEY_A).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        message(&body).contains("with the bearer token (iam) it was registered with: get a new token (oidc-token ACCOUNT, or htgettoken)"),
        "{body}"
    );
    m.stop().await;
}

#[tokio::test]
async fn each_refused_token_says_what_is_wrong_and_is_never_logged() {
    let (log, _guard) = CapturedLog::install(tracing::Level::DEBUG);
    let site = Site::new();
    let key = SigningKey::new("k1");
    let issuer = Issuer::start(site.dir.path(), &[&key]).await;
    let m = site.start_with(config(&site, &issuer), None).await;

    let claims = issuer.claims(SUBJECT, &["/cms"], "compute.read");
    let with = |change: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut claims = claims.clone();
        change(claims.as_object_mut().unwrap());
        key.sign(&claims)
    };
    let mut tokens = Vec::new();
    let mut refused = |status: StatusCode, token: String| {
        tokens.push(token.clone());
        let api = bearer(&site, &m, &token);
        async move { api.fails(status, api.get("/v1/whoami")).await.error.message }
    };

    let message = refused(
        StatusCode::UNAUTHORIZED,
        with(&|c| {
            c.insert("iss".into(), json!("https://other.test.invalid/"));
        }),
    )
    .await;
    assert!(message.contains("not one this site trusts"), "{message}");
    let message = refused(
        StatusCode::FORBIDDEN,
        with(&|c| {
            c.insert("aud".into(), json!("https://elsewhere.test.invalid"));
        }),
    )
    .await;
    assert!(
        message.contains(&format!("with audience {AUDIENCE}")),
        "{message}"
    );
    let message = refused(
        StatusCode::UNAUTHORIZED,
        SigningKey::new("k1").sign(&claims),
    )
    .await;
    assert!(message.contains("signature does not verify"), "{message}");
    let message = refused(
        StatusCode::UNAUTHORIZED,
        with(&|c| {
            c.insert("exp".into(), json!(Utc::now().timestamp() - 600));
        }),
    )
    .await;
    assert!(message.contains("expired at"), "{message}");
    // Signed, valid, but of a group the site does not admit.
    let message = refused(
        StatusCode::FORBIDDEN,
        with(&|c| {
            c.insert("wlcg.groups".into(), json!(["/atlas"]));
        }),
    )
    .await;
    assert!(
        message.contains("does not admit")
            && message.contains("shows /atlas")
            && message.contains("it needs the group /cms")
            && message.contains("ask your token issuer for a token with that group"),
        "{message}"
    );
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("k1".to_owned());
    let secret = EncodingKey::from_secret(&serde_json::to_vec(&key.public).unwrap()).unwrap();
    let message = refused(
        StatusCode::UNAUTHORIZED,
        jsonwebtoken::encode(&header, &claims, &secret).unwrap(),
    )
    .await;
    assert!(message.contains("RS256 and ES256"), "{message}");

    let nobody = m
        .anonymous
        .fails(StatusCode::UNAUTHORIZED, m.anonymous.get("/v1/whoami"))
        .await;
    assert!(
        nobody.error.message.contains("Authorization: Bearer"),
        "{nobody:?}"
    );
    m.stop().await;

    let text = log.text();
    assert!(text.contains("Request refused."), "{text}");
    for token in &tokens {
        let signature = token.rsplit('.').next().unwrap();
        assert!(!text.contains(signature), "a token was logged:\n{text}");
    }
}

#[tokio::test]
async fn rotated_keys_are_fetched_again_made_up_ones_are_not_and_retired_ones_are_refused() {
    let site = Site::new();
    let old = SigningKey::new("2026-11");
    let issuer = Issuer::start(site.dir.path(), &[&old]).await;
    let m = site.start_with(config(&site, &issuer), None).await;
    let whoami = |token: String| {
        let api = bearer(&site, &m, &token);
        async move { api.send(api.get("/v1/whoami")).await }
    };
    let claims = issuer.claims(SUBJECT, &["/cms"], "compute.read");

    let (status, body) = whoami(old.sign(&claims)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(issuer.fetches(), 1);
    let (status, _) = whoami(old.sign(&claims)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(issuer.fetches(), 1, "the keys are cached");

    // The issuer rotates: the new key in, the old one retired.
    let new = SigningKey::new("2026-12");
    issuer.publish(&[&new]);
    let (status, body) = whoami(new.sign(&claims)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(issuer.fetches(), 2, "an unknown kid fetched the keys again");

    let (status, body) = whoami(SigningKey::new("made-up").sign(&claims)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(message(&body).contains("no key \"made-up\""), "{body}");
    assert_eq!(issuer.fetches(), 2, "not fetched again within 30 s");
    let (status, body) = whoami(old.sign(&claims)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(message(&body).contains("no key \"2026-11\""), "{body}");
    m.stop().await;
}

#[tokio::test]
async fn an_admin_links_a_token_identity_to_a_users_dn() {
    let site = Site::new();
    let key = SigningKey::new("k1");
    let issuer = Issuer::start(site.dir.path(), &[&key]).await;
    let m = site.start_with(config(&site, &issuer), None).await;
    let user = bearer(
        &site,
        &m,
        &key.sign(&issuer.claims(SUBJECT, &["/cms"], ALL_BUT_CANCEL)),
    );
    let alice: WhoAmI = m.alice.ok(StatusCode::OK, m.alice.get("/v1/whoami")).await;

    let link = LinkToken {
        issuer: "iam".to_owned(),
        subject: SUBJECT.to_owned(),
        dn: Dn::parse(ALICE).unwrap(),
    };
    let refused = m
        .alice
        .fails(StatusCode::FORBIDDEN, m.alice.put("/v1/token-links", &link))
        .await;
    assert!(
        refused.error.message.starts_with("only admins"),
        "{refused:?}"
    );
    let made: TokenLinkView = m
        .admin
        .ok(StatusCode::OK, m.admin.put("/v1/token-links", &link))
        .await;
    assert_eq!(made.issuer, issuer.url);
    assert_eq!(made.issuer_name.as_deref(), Some("iam"));

    let me: WhoAmI = user.ok(StatusCode::OK, user.get("/v1/whoami")).await;
    assert_eq!(me.dn.as_str(), ALICE);
    assert_eq!(me.user_name, alice.user_name);
    assert_eq!(me.credential, Some(CredentialKind::Token));
    let links: Vec<TokenLinkView> = m
        .admin
        .ok(StatusCode::OK, m.admin.get("/v1/token-links"))
        .await;
    assert_eq!(links, [made]);

    let unknown = LinkToken {
        issuer: "elsewhere".to_owned(),
        ..link.clone()
    };
    let refused = m
        .admin
        .fails(
            StatusCode::NOT_FOUND,
            m.admin.put("/v1/token-links", &unknown),
        )
        .await;
    assert!(refused.error.message.contains("trusts iam"), "{refused:?}");
    let nobody = LinkToken {
        dn: Dn::parse("/DC=org/CN=Never Seen").unwrap(),
        ..link
    };
    let refused = m
        .admin
        .fails(
            StatusCode::NOT_FOUND,
            m.admin.put("/v1/token-links", &nobody),
        )
        .await;
    assert!(
        refused.error.message.contains("has used the site"),
        "{refused:?}"
    );

    let _: TokenLinkView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin
                .delete(&format!("/v1/token-links/iam/{}", urlencode(SUBJECT))),
        )
        .await;
    let me: WhoAmI = user.ok(StatusCode::OK, user.get("/v1/whoami")).await;
    assert_eq!(
        me.dn.as_str(),
        format!("/O=ongrid token/OU=iam/CN={SUBJECT}")
    );
    m.stop().await;
}
