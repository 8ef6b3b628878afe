//! Fuzzes the manager's bearer token check (`ongrid_manager::tokens::TokenVerifier::verify`)
//! against one issuer whose P-256 key is made at start-up and kept as a JWK set file. Each input
//! is tried twice: as the token itself (headers, parts, base64 and JSON as an attacker sends
//! them), and as the claims of a token the issuer signed (so the claim checks see every shape
//! of `aud`, `exp`, `scope`, `wlcg.groups` and the profile).
//!
//! Properties: nothing panics; every refusal renders; a token accepted says the configured
//! issuer, holds the site's audience, is not expired, and says a profile (`wlcg.ver` 1.0 or
//! `ver` scitoken:2.0).
#![no_main]

use std::future::Future;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use chrono::{DateTime, Utc};
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use libfuzzer_sys::fuzz_target;
use ongrid_manager::config::tokens::{KeySource, TokenIssuer};
use ongrid_manager::tokens::{TokenVerifier, VerifiedToken, SKEW};

const ISSUER: &str = "https://iam.fuzz.invalid/";
const AUDIENCE: &str = "https://ongrid.fuzz.invalid";

struct Fixture {
    verifier: TokenVerifier,
    key: EncodingKey,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let pair = rcgen::KeyPair::generate().expect("a P-256 key");
        let key = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).expect("PEM key");
        let mut public = Jwk::from_encoding_key(&key, Algorithm::ES256).expect("its JWK");
        public.common.key_id = Some("fuzz".to_owned());
        let dir = std::env::temp_dir().join(format!("ongrid-fuzz-jwks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the fixture directory");
        let jwks: PathBuf = dir.join("jwks.json");
        let set = JwkSet { keys: vec![public] };
        std::fs::write(&jwks, serde_json::to_vec(&set).expect("JSON")).expect("the JWK set");
        let issuer = TokenIssuer {
            name: "iam".to_owned(),
            issuer: ISSUER.to_owned(),
            audiences: vec![AUDIENCE.to_owned()],
            keys: KeySource::File(jwks),
            vos: Vec::new(),
            key_lifetime: None,
        };
        Fixture {
            verifier: TokenVerifier::new(&[issuer]).expect("the verifier"),
            key,
        }
    })
}

/// Runs the check as of `now` to its end: with a file as the key source nothing in it waits.
fn verify(token: &str, now: DateTime<Utc>) -> Option<VerifiedToken> {
    let mut future = pin!(fixture().verifier.verify(token, now));
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(Ok(verified)) => Some(verified),
        Poll::Ready(Err(error)) => {
            let _ = error.to_string();
            None
        }
        Poll::Pending => panic!("verify is pending with a JWK set file"),
    }
}

fn check_accepted(verified: &VerifiedToken, now: DateTime<Utc>) {
    assert_eq!(verified.issuer, ISSUER);
    let skew = chrono::Duration::from_std(SKEW).expect("skew");
    assert!(verified.expires_at + skew > now, "{verified:?}");
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let now = Utc::now();
    if let Some(verified) = verify(text, now) {
        check_accepted(&verified, now);
    }
    // The input as the claims of a token the issuer signed.
    let Ok(claims) = serde_json::from_str::<serde_json::Value>(text) else {
        return;
    };
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("fuzz".to_owned());
    let Ok(token) = jsonwebtoken::encode(&header, &claims, &fixture().key) else {
        return;
    };
    if let Some(verified) = verify(&token, now) {
        check_accepted(&verified, now);
        let audience = &claims["aud"];
        assert!(
            audience == AUDIENCE
                || audience
                    .as_array()
                    .is_some_and(|all| all.iter().any(|aud| aud == AUDIENCE)),
            "accepted with aud {audience}"
        );
        assert!(
            claims["wlcg.ver"] == "1.0"
                || claims["ver"] == "scitoken:2.0"
                || claims["ver"] == "scitokens:2.0",
            "accepted without a profile: {claims}"
        );
    }
});
