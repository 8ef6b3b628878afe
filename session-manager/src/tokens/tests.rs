//! Tokens minted here with keys made here (RSA by openssl, P-256 by rcgen), checked against a
//! JWK set file, as a site without outbound access configures its issuers. The https discovery
//! path is exercised end to end by `tests/api/tokens.rs`.

use std::path::{Path, PathBuf};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use super::*;
use crate::config::tokens::{KeySource, TokenIssuer};

const ISSUER: &str = "https://iam.test.invalid/";
const AUDIENCE: &str = "https://ongrid.test.invalid:8443";

/// A signing key of the test issuer, with its public JWK.
struct SigningKey {
    alg: Algorithm,
    kid: String,
    private: EncodingKey,
    public: Jwk,
}

impl SigningKey {
    fn rsa(kid: &str) -> Self {
        let output = std::process::Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
            ])
            .output()
            .expect("openssl genpkey");
        assert!(output.status.success(), "openssl genpkey failed");
        let private = EncodingKey::from_rsa_pem(&output.stdout).unwrap();
        Self::with(Algorithm::RS256, kid, private)
    }

    fn ec(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate().unwrap();
        let private = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
        Self::with(Algorithm::ES256, kid, private)
    }

    fn with(alg: Algorithm, kid: &str, private: EncodingKey) -> Self {
        let mut public = Jwk::from_encoding_key(&private, alg).unwrap();
        public.common.key_id = Some(kid.to_owned());
        Self {
            alg,
            kid: kid.to_owned(),
            private,
            public,
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.private).unwrap()
    }
}

fn now() -> DateTime<Utc> {
    Utc::now()
}

/// The claims of a WLCG token for `sub`, valid for an hour from now.
fn wlcg_claims(sub: &str) -> Value {
    let now = now().timestamp();
    json!({
        "iss": ISSUER,
        "sub": sub,
        "aud": AUDIENCE,
        "exp": now + 3600,
        "nbf": now - 10,
        "iat": now - 10,
        "jti": "2c8e2d1e-0000-4000-8000-000000000001",
        "wlcg.ver": "1.0",
        "scope": "compute.read compute.create",
        "wlcg.groups": ["/cms", "/cms/uscms", "/atlas"],
    })
}

fn write_keys(path: &Path, keys: &[&SigningKey]) {
    let set = JwkSet {
        keys: keys.iter().map(|key| key.public.clone()).collect(),
    };
    std::fs::write(path, serde_json::to_vec(&set).unwrap()).unwrap();
}

fn issuer(jwks: PathBuf, vos: &[&str]) -> TokenIssuer {
    TokenIssuer {
        name: "iam".to_owned(),
        issuer: ISSUER.to_owned(),
        audiences: vec![AUDIENCE.to_owned()],
        keys: KeySource::File(jwks),
        vos: vos.iter().map(|vo| (*vo).to_owned()).collect(),
        key_lifetime: None,
    }
}

struct Site {
    _dir: tempfile::TempDir,
    jwks: PathBuf,
    verifier: TokenVerifier,
}

fn site(keys: &[&SigningKey], vos: &[&str]) -> Site {
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    write_keys(&jwks, keys);
    let verifier = TokenVerifier::new(&[issuer(jwks.clone(), vos)]).unwrap();
    Site {
        _dir: dir,
        jwks,
        verifier,
    }
}

async fn refused(site: &Site, token: &str) -> String {
    site.verifier
        .verify(token, now())
        .await
        .expect_err("a token that must be refused was accepted")
        .to_string()
}

#[tokio::test]
async fn a_wlcg_token_signed_by_the_issuer_proves_its_subject_groups_and_scopes() {
    let key = SigningKey::rsa("rsa1");
    let site = site(&[&key], &[]);
    let token = key.sign(&wlcg_claims("e1eb758b-b73c-4761-bfff-adc793da409c"));
    let verified = site.verifier.verify(&token, now()).await.unwrap();
    assert_eq!(verified.issuer_name, "iam");
    assert_eq!(verified.issuer, ISSUER);
    assert_eq!(verified.subject, "e1eb758b-b73c-4761-bfff-adc793da409c");
    assert_eq!(verified.scopes, ["compute.read", "compute.create"]);
    let groups: Vec<String> = verified.groups.iter().map(ToString::to_string).collect();
    assert_eq!(groups.len(), 3, "{groups:?}");
    assert_eq!(verified.groups[1].vo(), "cms");
    assert_eq!(
        verified.missing(&[Right::Read, Right::Cancel, Right::Modify]),
        ["compute.cancel", "compute.modify"]
    );
}

#[tokio::test]
async fn an_es256_scitoken_is_accepted_and_groups_of_other_vos_are_dropped() {
    let key = SigningKey::ec("ec1");
    let site = site(&[&key], &["cms"]);
    let mut claims = wlcg_claims("alice");
    let object = claims.as_object_mut().unwrap();
    object.remove("wlcg.ver");
    object.insert("ver".to_owned(), json!("scitoken:2.0"));
    let verified = site
        .verifier
        .verify(&key.sign(&claims), now())
        .await
        .unwrap();
    let vos: Vec<&str> = verified.groups.iter().map(Fqan::vo).collect();
    assert_eq!(
        vos,
        ["cms", "cms"],
        "the /atlas group is not this issuer's to give"
    );
}

#[tokio::test]
async fn each_bad_claim_is_refused_with_what_to_do() {
    let key = SigningKey::rsa("rsa1");
    let site = site(&[&key], &[]);
    // Alice's token with the claim `name` set to `value`, or without it.
    let with = |name: &str, value: Option<Value>| {
        let mut claims = wlcg_claims("alice");
        let fields = claims.as_object_mut().unwrap();
        match value {
            Some(value) => fields.insert(name.to_owned(), value),
            None => fields.remove(name),
        };
        key.sign(&claims)
    };
    let hour_ago = now().timestamp() - 3600;

    let message = refused(
        &site,
        &with("iss", Some(json!("https://other.test.invalid/"))),
    )
    .await;
    assert!(message.contains("not one this site trusts"), "{message}");
    assert!(message.contains(ISSUER), "{message}");

    let message = refused(
        &site,
        &with("aud", Some(json!(["https://elsewhere.test.invalid"]))),
    )
    .await;
    assert!(
        message.contains("https://elsewhere.test.invalid"),
        "{message}"
    );
    assert!(message.contains(AUDIENCE), "{message}");

    let message = refused(&site, &with("exp", Some(json!(hour_ago)))).await;
    assert!(message.contains("expired at"), "{message}");
    assert!(message.contains("oidc-token"), "{message}");

    let message = refused(&site, &with("nbf", Some(json!(now().timestamp() + 3600)))).await;
    assert!(message.contains("not valid before"), "{message}");

    let message = refused(&site, &with("wlcg.ver", None)).await;
    assert!(message.contains("no profile"), "{message}");

    let message = refused(&site, &with("sub", None)).await;
    assert!(message.contains("lacks the claim sub"), "{message}");

    // Within the skew, an expiry just past is still accepted: clocks differ.
    let token = with("exp", Some(json!(now().timestamp() - 5)));
    site.verifier.verify(&token, now()).await.unwrap();
}

#[tokio::test]
async fn signatures_by_other_keys_none_and_hmac_are_refused() {
    let key = SigningKey::rsa("rsa1");
    let site = site(&[&key], &[]);
    let claims = wlcg_claims("alice");

    // Another key that claims the issuer's kid.
    let impostor = SigningKey::rsa("rsa1");
    let message = refused(&site, &impostor.sign(&claims)).await;
    assert!(message.contains("does not verify"), "{message}");

    // HS256 with the issuer's public key as the secret: the classic confusion.
    let public = serde_json::to_vec(&key.public).unwrap();
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("rsa1".to_owned());
    let secret = EncodingKey::from_secret(&public).unwrap();
    let hmac = jsonwebtoken::encode(&header, &claims, &secret).unwrap();
    let message = refused(&site, &hmac).await;
    assert!(message.contains("RS256 and ES256"), "{message}");

    // alg none, unsigned: the header {"alg":"none","typ":"JWT"} before the claims of a real token.
    let signed = key.sign(&claims);
    let payload = signed.split('.').nth(1).unwrap();
    let none = format!("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.{payload}.");
    let message = refused(&site, &none).await;
    assert!(
        message.contains("not a JWT") || message.contains("RS256"),
        "{message}"
    );

    let message = refused(&site, "not-a-token").await;
    assert!(message.contains("not a JWT"), "{message}");
}

#[tokio::test]
async fn a_rotated_key_is_read_from_the_changed_file() {
    let old = SigningKey::rsa("2026-01");
    let site = site(&[&old], &[]);
    site.verifier
        .verify(&old.sign(&wlcg_claims("alice")), now())
        .await
        .unwrap();

    let new = SigningKey::ec("2026-02");
    let token = new.sign(&wlcg_claims("alice"));
    let message = refused(&site, &token).await;
    assert!(message.contains("no key \"2026-02\""), "{message}");
    assert!(message.contains("2026-01"), "{message}");

    // The issuer rotates: the new key is published and the old one retired.
    write_keys(&site.jwks, &[&new]);
    site.verifier.verify(&token, now()).await.unwrap();
    let message = refused(&site, &old.sign(&wlcg_claims("alice"))).await;
    assert!(message.contains("no key \"2026-01\""), "{message}");
}

#[test]
fn each_request_needs_the_right_its_method_and_route_say() {
    let right = |method: Method, path: &str| Right::for_request(&method, path).scope();
    assert_eq!(right(Method::GET, "/v1/sessions"), "compute.read");
    assert_eq!(right(Method::POST, "/v1/sessions"), "compute.create");
    assert_eq!(right(Method::POST, "/v1/jobs/"), "compute.create");
    assert_eq!(right(Method::POST, "/v1/images"), "compute.create");
    assert_eq!(
        right(Method::DELETE, "/v1/sessions/train1"),
        "compute.cancel"
    );
    assert_eq!(
        right(Method::POST, "/v1/jobs/3f2b/cancel"),
        "compute.cancel"
    );
    assert_eq!(right(Method::POST, "/v1/jobs/3f2b/halt"), "compute.cancel");
    assert_eq!(
        right(Method::POST, "/v1/sessions/train1/hold"),
        "compute.modify"
    );
    assert_eq!(right(Method::POST, "/v1/keys"), "compute.modify");
    assert_eq!(right(Method::PUT, "/v1/gpus/GPU-1/mode"), "compute.modify");
}

mod properties {
    use proptest::prelude::*;

    use super::*;

    /// A site trusting one issuer with a P-256 key (fast to make: one per case, so that no
    /// temporary directory outlives the test).
    fn fresh() -> (Site, SigningKey) {
        let key = SigningKey::ec("p1");
        (site(&[&key], &[]), key)
    }

    fn verify(site: &Site, token: &str) -> Result<VerifiedToken, TokenError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(site.verifier.verify(token, now()))
    }

    fn b64(bytes: &[u8]) -> String {
        use std::fmt::Write as _;
        // base64url without padding, by hand: the test needs no base64 crate for this.
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
            for i in 0..=chunk.len() {
                let index = (n >> (18 - 6 * i)) & 63;
                let _ = write!(out, "{}", char::from(ALPHABET[index as usize]));
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever arrives as a token is refused with words, never a panic.
        #[test]
        fn any_text_is_refused_without_panic(text in ".{0,300}") {
            let (site, _) = fresh();
            let refused = verify(&site, &text);
            prop_assert!(refused.is_err());
            prop_assert!(!refused.unwrap_err().to_string().is_empty());
        }

        /// Three base64url parts of arbitrary bytes: refused, never a panic.
        #[test]
        fn any_three_parts_are_refused(
            header in proptest::collection::vec(any::<u8>(), 0..80),
            claims in proptest::collection::vec(any::<u8>(), 0..200),
            signature in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let token = format!("{}.{}.{}", b64(&header), b64(&claims), b64(&signature));
            let (site, _) = fresh();
            prop_assert!(verify(&site, &token).is_err());
        }

        /// Signed claims of any audience, expiry and profile: accepted only with the site's
        /// audience, an expiry ahead and a profile.
        #[test]
        fn signed_claims_are_accepted_only_when_every_rule_holds(
            audience_ok in any::<bool>(),
            expires_in in -7200i64..7200,
            profile in 0u8..3,
        ) {
            let mut claims = wlcg_claims("prop");
            let object = claims.as_object_mut().unwrap();
            if !audience_ok {
                object.insert("aud".into(), json!("https://elsewhere.test.invalid"));
            }
            object.insert("exp".into(), json!(now().timestamp() + expires_in));
            object.remove("wlcg.ver");
            match profile {
                0 => {}
                1 => { object.insert("wlcg.ver".into(), json!("1.0")); }
                _ => { object.insert("ver".into(), json!("scitoken:2.0")); }
            }
            let (site, key) = fresh();
            let accepted = verify(&site, &key.sign(&claims)).is_ok();
            // Within the 60 s skew either answer is right.
            if (-61..=0).contains(&expires_in) {
                return Ok(());
            }
            prop_assert_eq!(accepted, audience_ok && expires_in > 0 && profile != 0);
        }
    }
}
