//! Bearer tokens beside grid certificates: JWTs of the WLCG common JWT profile and SciTokens,
//! from the issuers of the config's `[[token_issuers]]`.
//!
//! [`TokenVerifier::verify`] takes a token from `Authorization: Bearer` and returns what it
//! proves ([`VerifiedToken`]) or why it is refused ([`TokenError`], each with its fix):
//! - the issuer (`iss`) must be one the site lists, exactly;
//! - the signature must be RS256 or ES256 by a key of that issuer's JWK set (never `none`, never
//!   an HMAC: a public key is no secret), found by the header's `kid` ([`keys`]);
//! - `aud` must hold one of the issuer's accepted audiences; `exp`, `nbf` and `iat` are checked
//!   against the manager's clock with [`SKEW`];
//! - the token must say its profile: `wlcg.ver` `1.0`, or `ver` `scitoken:2.0`.
//!
//! Its `scope` grants rights ([`Right`], the WLCG profile's `compute.*` scopes), checked per
//! request; its `wlcg.groups` are the caller's groups, matched by the site's `fqan` and `vo`
//! rules and admins as VOMS FQANs are (`/cms/uscms` is group `/cms/uscms` of VO `cms`).
//! The token itself is never logged nor put in an error.

pub mod keys;

use std::collections::HashSet;
use std::time::Duration;

use axum::http::Method;
use chrono::{DateTime, Utc};
use jsonwebtoken::jwk::KeyAlgorithm;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use ongrid_x509::voms::Fqan;
use serde::Deserialize;

use crate::config::tokens::TokenIssuer;
use keys::{IssuerKeys, KeyError};

/// How far the manager's clock may be from the issuer's.
pub const SKEW: Duration = Duration::from_secs(60);

/// The most a bearer token may weigh (WLCG tokens are a few KiB).
const MAX_TOKEN: usize = 16 * 1024;

/// The issuers a site trusts, with their keys.
pub struct TokenVerifier {
    issuers: Vec<(TokenIssuer, IssuerKeys)>,
}

/// What a verified token proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedToken {
    /// The config's name of the issuer.
    pub issuer_name: String,
    /// The `iss` claim.
    pub issuer: String,
    /// The `sub` claim.
    pub subject: String,
    /// The `scope` claim's entries.
    pub scopes: Vec<String>,
    /// `wlcg.groups`, as FQANs (the ones of VOs the issuer may speak for).
    pub groups: Vec<Fqan>,
    /// The `exp` claim.
    pub expires_at: DateTime<Utc>,
    /// How long SSH keys registered with it live (the issuer's `key_lifetime`), when the site
    /// sets it; else they expire with the token.
    pub key_lifetime: Option<Duration>,
}

/// A right a request needs, granted by a scope of the WLCG profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Right {
    /// Read: list and show sessions, jobs, images, GPUs (`compute.read`).
    Read,
    /// Create sessions, jobs and images (`compute.create`).
    Create,
    /// Change them: hold, release, keep, SSH keys, sharing, admin changes (`compute.modify`).
    Modify,
    /// Remove sessions, images and jobs; cancel and halt jobs (`compute.cancel`).
    Cancel,
}

/// Why a bearer token is refused. Each message says what to do; none holds the token.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("this site accepts no bearer tokens: connect with your grid certificate or proxy (devctl --cert)")]
    NotAccepted,
    #[error("the bearer token is not a JWT ({0}): send the access token your issuer gave (oidc-token ACCOUNT, htgettoken), whole")]
    Malformed(String),
    #[error("the bearer token's issuer {0:?} is not one this site trusts: get a token from one of the site's issuers ({1})")]
    UnknownIssuer(String, String),
    #[error(
        "the bearer token is signed with {0:?}: this site takes RS256 and ES256 signatures only"
    )]
    Algorithm(String),
    #[error("the bearer token of {issuer} cannot be checked: {cause}")]
    Key { issuer: String, cause: KeyError },
    #[error("the bearer token's signature does not verify with the key of {0} it names: get a new token from the issuer")]
    Signature(String),
    #[error("the bearer token is for audience {found}, not this site: ask your issuer for a token with audience {wanted} (oidc-token --aud=...)")]
    Audience { found: String, wanted: String },
    #[error("the bearer token expired at {0} ({1} ago): get a new one (oidc-token ACCOUNT, or htgettoken)")]
    Expired(DateTime<Utc>, String),
    #[error("the bearer token is not valid before {0}: check this machine's clock, or wait")]
    NotYetValid(DateTime<Utc>),
    #[error("the bearer token lacks the claim {0}: the site takes tokens of the WLCG common JWT profile and SciTokens")]
    MissingClaim(String),
    #[error("the bearer token says no profile (neither wlcg.ver 1.0 nor ver scitoken:2.0): the site takes tokens of the WLCG common JWT profile and SciTokens")]
    Profile,
    #[error("the bearer token's claims cannot be read ({0}): get a new token from the issuer")]
    Claims(String),
}

impl TokenError {
    /// Whether the token is fine but this site is not its audience, or it lacks what is
    /// needed: 403 rather than 401.
    pub fn is_forbidden(&self) -> bool {
        matches!(self, Self::Audience { .. })
    }
}

/// The claims read from a token whose signature verified.
#[derive(Deserialize)]
struct Claims {
    #[serde(default)]
    sub: Option<String>,
    #[serde(default)]
    exp: Option<i64>,
    #[serde(default)]
    nbf: Option<i64>,
    #[serde(default)]
    iat: Option<i64>,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default, rename = "wlcg.groups")]
    groups: Option<Vec<String>>,
    #[serde(default, rename = "wlcg.ver")]
    wlcg_ver: Option<String>,
    #[serde(default)]
    ver: Option<String>,
}

#[derive(Deserialize)]
struct UnverifiedIssuer {
    #[serde(default)]
    iss: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum AudienceClaim {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct UnverifiedAudience {
    #[serde(default)]
    aud: Option<AudienceClaim>,
}

impl TokenVerifier {
    /// The verifier of `issuers`; fails when an issuer's CA file cannot be read.
    pub fn new(issuers: &[TokenIssuer]) -> Result<Self, String> {
        let issuers = issuers
            .iter()
            .map(|issuer| {
                IssuerKeys::new(&issuer.issuer, &issuer.keys)
                    .map(|keys| (issuer.clone(), keys))
                    .map_err(|e| format!("token issuer {}: {e}", issuer.name))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { issuers })
    }

    /// Whether any issuer is trusted.
    pub fn accepts_tokens(&self) -> bool {
        !self.issuers.is_empty()
    }

    /// The issuer named `name_or_url` (its config name or its `iss` URL).
    pub fn issuer(&self, name_or_url: &str) -> Option<&TokenIssuer> {
        self.issuers
            .iter()
            .map(|(issuer, _)| issuer)
            .find(|issuer| issuer.name == name_or_url || issuer.issuer == name_or_url)
    }

    /// The config names of the trusted issuers.
    pub fn names(&self) -> Vec<&str> {
        self.issuers
            .iter()
            .map(|(issuer, _)| issuer.name.as_str())
            .collect()
    }

    /// What `token` proves as of `now`, or why it is refused.
    pub async fn verify(
        &self,
        token: &str,
        now: DateTime<Utc>,
    ) -> Result<VerifiedToken, TokenError> {
        if self.issuers.is_empty() {
            return Err(TokenError::NotAccepted);
        }
        if token.len() > MAX_TOKEN {
            return Err(TokenError::Malformed("longer than 16 KiB".to_owned()));
        }
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| TokenError::Malformed(e.to_string()))?;
        let (issuer, keys) = self.issuer_of(token)?;
        if !matches!(header.alg, Algorithm::RS256 | Algorithm::ES256) {
            return Err(TokenError::Algorithm(format!("{:?}", header.alg)));
        }
        let key = decoding_key(issuer, keys, &header).await?;
        let mut validation = Validation::new(header.alg);
        // Times are checked below against the manager's clock, with its messages.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.set_required_spec_claims(&["exp", "iss", "sub", "aud"]);
        validation.set_issuer(&[&issuer.issuer]);
        validation.set_audience(&issuer.audiences);
        let mut claims = match jsonwebtoken::decode::<Claims>(token, &key, &validation) {
            Ok(data) => data.claims,
            Err(error) => return Err(refusal(error.into_kind(), issuer, token)),
        };
        let subject = claims
            .sub
            .take()
            .filter(|sub| !sub.is_empty())
            .ok_or_else(|| TokenError::MissingClaim("sub".to_owned()))?;
        let expires_at = check_times(&claims, now)?;
        check_profile(&claims)?;
        let scopes = claims
            .scope
            .as_deref()
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let groups = groups(claims.groups.unwrap_or_default(), issuer);
        Ok(VerifiedToken {
            issuer_name: issuer.name.clone(),
            issuer: issuer.issuer.clone(),
            subject,
            scopes,
            groups,
            expires_at,
            key_lifetime: issuer.key_lifetime,
        })
    }

    /// The trusted issuer `token` says it comes from (its `iss`, read before any check), and
    /// that issuer's keys.
    fn issuer_of(&self, token: &str) -> Result<(&TokenIssuer, &IssuerKeys), TokenError> {
        let unverified: UnverifiedIssuer = jsonwebtoken::dangerous::insecure_decode_claims(token)
            .map_err(|e| TokenError::Malformed(e.to_string()))?;
        let iss = unverified
            .iss
            .ok_or_else(|| TokenError::MissingClaim("iss".to_owned()))?;
        let found = self.issuers.iter().find(|(issuer, _)| issuer.issuer == iss);
        let Some((issuer, keys)) = found else {
            let names: Vec<&str> = self
                .issuers
                .iter()
                .map(|(issuer, _)| issuer.issuer.as_str())
                .collect();
            return Err(TokenError::UnknownIssuer(iss, names.join(", ")));
        };
        Ok((issuer, keys))
    }
}

/// The issuer's key the header names, usable for the header's algorithm only.
async fn decoding_key(
    issuer: &TokenIssuer,
    keys: &IssuerKeys,
    header: &jsonwebtoken::Header,
) -> Result<DecodingKey, TokenError> {
    let jwk = keys
        .key(header.kid.as_deref())
        .await
        .map_err(|cause| TokenError::Key {
            issuer: issuer.issuer.clone(),
            cause,
        })?;
    // A key published for one algorithm signs nothing else.
    if jwk
        .common
        .key_algorithm
        .is_some_and(|alg| alg != KeyAlgorithm::from(header.alg))
    {
        return Err(TokenError::Signature(issuer.issuer.clone()));
    }
    DecodingKey::from_jwk(&jwk).map_err(|e| TokenError::Key {
        issuer: issuer.issuer.clone(),
        cause: KeyError::Unavailable(format!("its key cannot be used: {e}")),
    })
}

/// The token's times against the manager's clock, with [`SKEW`] either way: not expired, not
/// before its `nbf`, not issued in the future. Answers when it expires.
fn check_times(claims: &Claims, now: DateTime<Utc>) -> Result<DateTime<Utc>, TokenError> {
    let skew = chrono::Duration::from_std(SKEW).unwrap_or_default();
    let exp = claims
        .exp
        .ok_or_else(|| TokenError::MissingClaim("exp".to_owned()))?;
    let expires_at = timestamp(exp, "exp")?;
    if now >= expires_at + skew {
        return Err(TokenError::Expired(expires_at, ago(now - expires_at)));
    }
    if let Some(nbf) = claims.nbf {
        let not_before = timestamp(nbf, "nbf")?;
        if not_before > now + skew {
            return Err(TokenError::NotYetValid(not_before));
        }
    }
    if let Some(iat) = claims.iat {
        let issued_at = timestamp(iat, "iat")?;
        if issued_at > now + skew {
            return Err(TokenError::NotYetValid(issued_at));
        }
    }
    Ok(expires_at)
}

/// A WLCG (`wlcg.ver` 1.0) or SciTokens (`ver` scitoken:2.0) token; any other is refused.
fn check_profile(claims: &Claims) -> Result<(), TokenError> {
    let wlcg = claims.wlcg_ver.as_deref() == Some("1.0");
    let scitoken = claims
        .ver
        .as_deref()
        .is_some_and(|ver| ver == "scitoken:2.0" || ver == "scitokens:2.0");
    if wlcg || scitoken {
        Ok(())
    } else {
        Err(TokenError::Profile)
    }
}

/// The refusal for a failed `decode`.
fn refusal(kind: jsonwebtoken::errors::ErrorKind, issuer: &TokenIssuer, token: &str) -> TokenError {
    use jsonwebtoken::errors::ErrorKind;
    match kind {
        ErrorKind::InvalidAudience => {
            let found =
                match jsonwebtoken::dangerous::insecure_decode_claims::<UnverifiedAudience>(token)
                    .ok()
                    .and_then(|claims| claims.aud)
                {
                    Some(AudienceClaim::One(aud)) => aud,
                    Some(AudienceClaim::Many(auds)) => auds.join(", "),
                    None => "(none)".to_owned(),
                };
            TokenError::Audience {
                found,
                wanted: issuer.audiences.join(" or "),
            }
        }
        ErrorKind::MissingRequiredClaim(claim) => TokenError::MissingClaim(claim),
        ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm => {
            TokenError::Signature(issuer.issuer.clone())
        }
        ErrorKind::InvalidToken | ErrorKind::Base64(_) | ErrorKind::Utf8(_) => {
            TokenError::Malformed(format!("{kind:?}"))
        }
        other => TokenError::Claims(format!("{other:?}")),
    }
}

/// The token's groups as FQANs: each a VO's group (`/cms/uscms`), kept when the issuer may speak
/// for its VO.
fn groups(claimed: Vec<String>, issuer: &TokenIssuer) -> Vec<Fqan> {
    let mut groups = Vec::new();
    for group in claimed {
        match Fqan::parse(&group) {
            Ok(fqan) if issuer.vos.is_empty() || issuer.vos.iter().any(|vo| vo == fqan.vo()) => {
                groups.push(fqan);
            }
            Ok(_) => {
                tracing::info!(issuer = %issuer.name, %group, "Token group left out: its VO is not one this issuer may speak for (vos).");
            }
            Err(error) => {
                tracing::info!(issuer = %issuer.name, %group, %error, "Token group left out: not a group path like /vo/group.");
            }
        }
    }
    groups
}

fn timestamp(seconds: i64, claim: &str) -> Result<DateTime<Utc>, TokenError> {
    DateTime::from_timestamp(seconds, 0)
        .ok_or_else(|| TokenError::Claims(format!("{claim} {seconds} is not a time")))
}

fn ago(elapsed: chrono::Duration) -> String {
    let seconds = elapsed.num_seconds().max(0);
    match seconds {
        0..=119 => format!("{seconds} s"),
        120..=7199 => format!("{} min", seconds / 60),
        _ => format!("{} h", seconds / 3600),
    }
}

impl Right {
    /// The right a request needs: reading for GET, creating for new sessions, jobs and images,
    /// cancelling for removals, cancels and halts, modifying for the rest.
    pub fn for_request(method: &Method, path: &str) -> Self {
        let path = path.trim_end_matches('/');
        if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
            Self::Read
        } else if *method == Method::DELETE || path.ends_with("/cancel") || path.ends_with("/halt")
        {
            Self::Cancel
        } else if *method == Method::POST
            && matches!(path, "/v1/sessions" | "/v1/jobs" | "/v1/images")
        {
            Self::Create
        } else {
            Self::Modify
        }
    }

    /// The scope that grants it.
    pub fn scope(self) -> &'static str {
        match self {
            Self::Read => "compute.read",
            Self::Create => "compute.create",
            Self::Modify => "compute.modify",
            Self::Cancel => "compute.cancel",
        }
    }

    /// Every right: what a dashboard login made with a token needs, since the dashboard does
    /// all of it.
    pub const ALL: [Right; 4] = [Self::Read, Self::Create, Self::Modify, Self::Cancel];
}

impl VerifiedToken {
    /// The scopes of `rights` the token lacks.
    pub fn missing(&self, rights: &[Right]) -> Vec<&'static str> {
        let granted: HashSet<&str> = self.scopes.iter().map(String::as_str).collect();
        rights
            .iter()
            .map(|right| right.scope())
            .filter(|scope| !granted.contains(scope))
            .collect()
    }
}

#[cfg(test)]
mod tests;
