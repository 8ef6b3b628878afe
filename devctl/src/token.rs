//! The user's OAuth2 bearer token (a WLCG common JWT profile token or a SciToken), which devctl
//! sends instead of presenting a certificate when it finds one.
//!
//! [`crate::config`] finds it as WLCG Bearer Token Discovery says ([`TokenSource`]); here it is
//! read and looked at before anything is sent: a token file others may read is refused like a
//! key, and an empty file, something that is not a JWT, or a token that has already expired is
//! refused with one line naming where it came from and how to get a new one. Its claims are
//! decoded without verifying the signature: only `exp`, `iss` and `sub` are read, for these
//! messages. The manager verifies the token.

use std::fmt;
use std::path::PathBuf;

use chrono::{DateTime, Utc};
use ongrid_service::Token;
use serde::Deserialize;

use crate::format::{format_time, time_left};
use crate::origin::Origin;
use crate::permissions::shell_word;

/// A bearer token itself (WLCG Bearer Token Discovery).
pub const ENV_BEARER_TOKEN: &str = "BEARER_TOKEN";
/// The file of a bearer token.
pub const ENV_BEARER_TOKEN_FILE: &str = "BEARER_TOKEN_FILE";

/// Where devctl found the bearer token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// `BEARER_TOKEN`: the token itself.
    Variable(Token),
    /// A file: named by `BEARER_TOKEN_FILE` (origin `Env(BEARER_TOKEN_FILE)`), or found at
    /// `$XDG_RUNTIME_DIR/bt_u<uid>` (origin `Env(XDG_RUNTIME_DIR)`) or `/tmp/bt_u<uid>`
    /// (origin `Default`).
    File { path: PathBuf, origin: Origin },
}

impl TokenSource {
    /// How to get a new token to where devctl looks first.
    fn fix(&self) -> String {
        match self {
            Self::Variable(_) => format!(
                "get a new one (export {ENV_BEARER_TOKEN}=$(oidc-token ACCOUNT)), or unset \
                 {ENV_BEARER_TOKEN} and run htgettoken"
            ),
            Self::File { path, .. } => format!(
                "get a new one (oidc-token ACCOUNT > {}, or htgettoken)",
                shell_word(path)
            ),
        }
    }
}

/// `BEARER_TOKEN`, `BEARER_TOKEN_FILE /path`, or the path of a file found where tokens are
/// kept (`/run/user/1000/bt_u1000`).
impl fmt::Display for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Variable(_) => f.write_str(ENV_BEARER_TOKEN),
            Self::File {
                path,
                origin: Origin::Env(var),
            } if *var == ENV_BEARER_TOKEN_FILE => write!(f, "{var} {}", path.display()),
            Self::File { path, .. } => write!(f, "{}", path.display()),
        }
    }
}

/// Why the token cannot be sent. Each message names where it came from and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The token file is open to others.
    #[error(transparent)]
    TooOpen(#[from] crate::permissions::TooOpen),
    #[error("cannot read the bearer token from {from} ({cause}): {fix}", fix = from.fix())]
    Unreadable { from: TokenSource, cause: String },
    #[error("the bearer token from {from} is empty: {fix}", fix = from.fix())]
    Empty { from: TokenSource },
    #[error("the bearer token from {from} is not a JWT ({problem}): {fix}", fix = from.fix())]
    NotAJwt { from: TokenSource, problem: String },
    #[error("the bearer token from {from} expired at {} ({} ago): {fix}", format_time(*at), time_left(*now, *at), fix = from.fix())]
    Expired {
        from: TokenSource,
        at: DateTime<Utc>,
        now: DateTime<Utc>,
    },
}

/// The claims devctl reads, unverified, for its messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    /// `iss`: the issuer.
    pub issuer: Option<String>,
    /// `sub`: who the issuer says the bearer is.
    pub subject: Option<String>,
    /// `exp`: when the token expires.
    pub expires_at: Option<DateTime<Utc>>,
}

/// The payload as written: NumericDate may be written with a fraction.
#[derive(Deserialize)]
struct Payload {
    iss: Option<String>,
    sub: Option<String>,
    exp: Option<f64>,
}

/// A bearer token, read and found usable (as far as devctl can tell: the manager verifies it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BearerToken {
    pub token: Token,
    pub source: TokenSource,
    pub claims: Claims,
}

impl BearerToken {
    /// Reads the token from `source` and refuses it when it cannot be sent at `now`.
    pub fn load(source: &TokenSource, now: DateTime<Utc>) -> Result<Self, TokenError> {
        let text = match source {
            TokenSource::Variable(token) => token.expose().to_owned(),
            TokenSource::File { path, .. } => {
                crate::permissions::check(path, "bearer token file")?;
                std::fs::read_to_string(path).map_err(|err| TokenError::Unreadable {
                    from: source.clone(),
                    cause: err.to_string(),
                })?
            }
        };
        let token = Token::new(&text);
        if token.expose().is_empty() {
            return Err(TokenError::Empty {
                from: source.clone(),
            });
        }
        let claims = read_claims(token.expose()).map_err(|problem| TokenError::NotAJwt {
            from: source.clone(),
            problem,
        })?;
        if let Some(at) = claims.expires_at.filter(|at| *at <= now) {
            return Err(TokenError::Expired {
                from: source.clone(),
                at,
                now,
            });
        }
        Ok(Self {
            token,
            source: source.clone(),
            claims,
        })
    }
}

/// The claims of a JWS compact serialization (three base64url parts separated by dots),
/// decoded without verifying its signature; `Err` says what is wrong, without the token.
fn read_claims(token: &str) -> Result<Claims, String> {
    let parts: Vec<&str> = token.split('.').collect();
    if parts.len() != 3 {
        return Err("it is not three base64url parts separated by dots".to_owned());
    }
    let base64url = |part: &str| {
        !part.is_empty()
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !parts.iter().all(|part| base64url(part)) {
        return Err("a part of it is empty or not base64url".to_owned());
    }
    let payload: Payload = jsonwebtoken::dangerous::insecure_decode_claims(token)
        .map_err(|err| format!("its payload is not a JSON object of claims: {err}"))?;
    let expires_at = match payload.exp {
        None => None,
        Some(exp) => Some(
            DateTime::from_timestamp(exp.floor() as i64, 0)
                .ok_or_else(|| format!("its exp claim {exp} is not a time"))?,
        ),
    };
    Ok(Claims {
        issuer: payload.iss,
        subject: payload.sub,
        expires_at,
    })
}

/// A token with `claims` as its payload, signed with HS256 and a made-up secret (devctl does
/// not look at the signature), for tests.
#[cfg(test)]
pub(crate) fn test_jwt(claims: &serde_json::Value) -> String {
    let key = jsonwebtoken::EncodingKey::from_secret(b"not the issuer's key").expect("an HMAC key");
    jsonwebtoken::encode(&jsonwebtoken::Header::default(), claims, &key).expect("a JWT")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn jwt(claims: &serde_json::Value) -> String {
        test_jwt(claims)
    }

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    fn private(path: &Path) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    fn from_file(path: &Path) -> TokenSource {
        TokenSource::File {
            path: path.to_path_buf(),
            origin: Origin::Env(ENV_BEARER_TOKEN_FILE),
        }
    }

    #[test]
    fn a_token_file_is_read_trimmed_and_its_claims_decoded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bt_u1000");
        let token = jwt(&serde_json::json!({
            "iss": "https://iam.test.invalid/",
            "sub": "e1eb758b-b73c-4761-bfff-adc793da409c",
            "exp": 1_795_255_200 + 3600,
            "scope": "compute.create compute.read",
        }));
        std::fs::write(&path, format!("\n  {token}\n")).unwrap();
        private(&path);
        let loaded = BearerToken::load(&from_file(&path), at(0)).unwrap();
        assert_eq!(loaded.token.expose(), token);
        assert_eq!(
            loaded.claims,
            Claims {
                issuer: Some("https://iam.test.invalid/".into()),
                subject: Some("e1eb758b-b73c-4761-bfff-adc793da409c".into()),
                expires_at: Some(at(3600)),
            }
        );
        assert_eq!(
            loaded.source.to_string(),
            format!("BEARER_TOKEN_FILE {}", path.display())
        );
        // Never printed, not even in Debug.
        assert!(!format!("{loaded:?}").contains(&token));

        // A token without exp is left to the manager.
        let variable = TokenSource::Variable(Token::new(&jwt(&serde_json::json!({"sub": "x"}))));
        let loaded = BearerToken::load(&variable, at(0)).unwrap();
        assert_eq!(loaded.claims.expires_at, None);
        assert_eq!(loaded.source.to_string(), "BEARER_TOKEN");
    }

    #[test]
    fn an_expired_token_is_refused_with_how_to_get_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bt_u1000");
        std::fs::write(&path, jwt(&serde_json::json!({"exp": 1_795_255_200 - 600}))).unwrap();
        private(&path);
        let err = BearerToken::load(&from_file(&path), at(0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "the bearer token from BEARER_TOKEN_FILE {p} expired at 2026-11-21 09:50:00Z \
                 (10m 0s ago): get a new one (oidc-token ACCOUNT > {p}, or htgettoken)",
                p = path.display()
            )
        );
        let variable = TokenSource::Variable(Token::new(&jwt(
            &serde_json::json!({"exp": 1_795_255_200 - 7200}),
        )));
        assert_eq!(
            BearerToken::load(&variable, at(0)).unwrap_err().to_string(),
            "the bearer token from BEARER_TOKEN expired at 2026-11-21 08:00:00Z (2h 0m ago): get \
             a new one (export BEARER_TOKEN=$(oidc-token ACCOUNT)), or unset BEARER_TOKEN and \
             run htgettoken"
        );
        // At the second of expiry it is expired; a second before, it is not.
        let edge =
            TokenSource::Variable(Token::new(&jwt(&serde_json::json!({"exp": 1_795_255_200}))));
        assert!(matches!(
            BearerToken::load(&edge, at(0)),
            Err(TokenError::Expired { .. })
        ));
        assert!(BearerToken::load(&edge, at(-1)).is_ok());
    }

    #[test]
    fn a_token_file_others_may_read_is_refused_like_a_key() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bt_u1000");
        std::fs::write(&path, jwt(&serde_json::json!({}))).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = BearerToken::load(&from_file(&path), at(0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "bearer token file {p} has mode 0644, open to its group or others, which devctl \
                 refuses as ssh does: run `chmod 600 {p}`",
                p = path.display()
            )
        );
        private(&path);
        assert!(BearerToken::load(&from_file(&path), at(0)).is_ok());
    }

    #[test]
    fn empty_missing_and_malformed_tokens_say_what_and_where() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bt_u1000");
        std::fs::write(&path, " \n\n").unwrap();
        private(&path);
        let source = TokenSource::File {
            path: path.clone(),
            origin: Origin::Env("XDG_RUNTIME_DIR"),
        };
        assert_eq!(
            BearerToken::load(&source, at(0)).unwrap_err().to_string(),
            format!(
                "the bearer token from {p} is empty: get a new one (oidc-token ACCOUNT > {p}, or \
                 htgettoken)",
                p = path.display()
            )
        );

        let missing = dir.path().join("missing");
        let err = BearerToken::load(&from_file(&missing), at(0)).unwrap_err();
        assert!(matches!(err, TokenError::Unreadable { .. }), "{err}");
        assert!(
            err.to_string().starts_with(&format!(
                "cannot read the bearer token from BEARER_TOKEN_FILE {} (",
                missing.display()
            )),
            "{err}"
        );

        // `{"alg":"ES256"}` and `not json`, base64url.
        let payload_not_json = "eyJhbGciOiJFUzI1NiJ9.bm90IGpzb24.c2ln";
        for (token, problem) in [
            (
                "s3cret-opaque-token",
                "it is not three base64url parts separated by dots",
            ),
            (
                "a.b.c.d",
                "it is not three base64url parts separated by dots",
            ),
            ("a..c", "a part of it is empty or not base64url"),
            ("a.b+c.d", "a part of it is empty or not base64url"),
            ("a.b c.d", "a part of it is empty or not base64url"),
            (
                payload_not_json,
                "its payload is not a JSON object of claims: ",
            ),
        ] {
            let source = TokenSource::Variable(Token::new(token));
            let err = BearerToken::load(&source, at(0)).unwrap_err();
            let text = err.to_string();
            assert!(
                text.starts_with(&format!(
                    "the bearer token from BEARER_TOKEN is not a JWT ({problem}"
                )),
                "{token}: {text}"
            );
            assert!(
                text.contains("oidc-token") && text.contains("htgettoken"),
                "{text}"
            );
            assert!(!text.contains("s3cret"), "{text}");
        }
    }
}
