//! The dashboard's single-use login links (`POST /v1/dashboard/links`, `devctl dashboard`): a
//! random token, good once for [`LINK_LIFETIME`] (never past the credential's end), whose
//! SHA-256 digest is stored with the identity it was made for. The dashboard spends it
//! (`crate::dashboard::auth`) for a browser login; only digests of tokens are ever stored.
//!
//! A link may lead to a page of the dashboard ([`NextPath`], like a session's JupyterLab for
//! `devctl session web`): the login form carries it and the login redirects there. The path is
//! checked where it enters (the API's body, the link's query, the form), each time with
//! [`NextPath::parse`], so the login never redirects off the dashboard.

use std::fmt;

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::api::DashboardLink;
use ongrid_core::Dn;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sha2::{Digest, Sha256};

use super::caller::CurrentUser;
use super::{ApiError, AppState};
use crate::store::{DashboardIdentity, DashboardLogin};
use crate::tokens::Right;

/// How long a login link printed by `devctl dashboard` may be used.
pub const LINK_LIFETIME: TimeDelta = TimeDelta::minutes(5);

/// The longest [`NextPath`], in bytes.
pub const NEXT_PATH_MAX: usize = 1024;

/// A page of the dashboard to land on once logged in: a path under `/dashboard/` (query and
/// fragment allowed) that no browser reads as another site or as a path outside the dashboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextPath(String);

/// Why a next path was refused; the message says what one must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the next path {problem}: a next path must be a path under /dashboard/ (like \
     /dashboard/sessions/NAME/apps/jupyter/) of at most 1024 bytes of visible ASCII \
     (percent-encode the rest), without `//`, a backslash, or a `.` or `..` segment"
)]
pub struct BadNextPath {
    problem: &'static str,
}

impl NextPath {
    /// Checks `text` (as sent: percent-encoded where it needs to be). The rules keep every
    /// browser on this origin and under `/dashboard/`: the prefix rules out a scheme (`https:`)
    /// and a host; no `//` (a network-path reference) or backslash (which browsers read as
    /// `/`); no `.` or `..` segment, spelt out or as `%2e` (browsers resolve both); nothing but
    /// visible ASCII, so the path is a valid `Location` header as it is.
    pub fn parse(text: &str) -> Result<Self, BadNextPath> {
        let refuse = |problem| Err(BadNextPath { problem });
        if text.len() > NEXT_PATH_MAX {
            return refuse("is longer than 1024 bytes");
        }
        if !text.bytes().all(|byte| byte.is_ascii_graphic()) {
            return refuse("holds a space, a control character or a non-ASCII character");
        }
        if !text.starts_with("/dashboard/") {
            return refuse("does not start with /dashboard/");
        }
        if text.contains("//") {
            return refuse("holds `//`");
        }
        if text.contains('\\') {
            return refuse("holds a backslash");
        }
        let path = text.split(['?', '#']).next().unwrap_or_default();
        let dot_segment = path.split('/').any(|segment| {
            let segment = segment.to_ascii_lowercase().replace("%2e", ".");
            segment == "." || segment == ".."
        });
        if dot_segment {
            return refuse("holds a `.` or `..` segment");
        }
        Ok(Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The path as one value of a URL's query (`&next=...`): `/` stays readable, every other
    /// character that is not a letter, a digit or `-._~` is percent-encoded.
    pub fn query_value(&self) -> impl fmt::Display + '_ {
        const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
            .remove(b'-')
            .remove(b'.')
            .remove(b'_')
            .remove(b'~')
            .remove(b'/');
        utf8_percent_encode(&self.0, QUERY_VALUE)
    }
}

impl fmt::Display for NextPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// 32 bytes' worth of hex from the system's random source (two v4 UUIDs: 244 random bits).
pub fn random_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// What is stored for a token.
pub fn digest(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A single-use login link for the caller, leading to `next` (else the dashboard's front
/// page). A limited proxy may only read, so it gets none; a bearer token needs every
/// `compute.*` scope, since the dashboard does all of it.
pub async fn create_link(
    state: &AppState,
    caller: &CurrentUser,
    next: Option<&NextPath>,
) -> Result<DashboardLink, ApiError> {
    if caller.is_limited() {
        return Err(ApiError::forbidden(
            "a limited proxy may only read, and the dashboard changes sessions: make a full \
             proxy (grid-proxy-init or voms-proxy-init without -limited) and run devctl \
             dashboard again",
        ));
    }
    if let Some(token) = &caller.identity.token {
        let missing = token.missing(&Right::ALL);
        if !missing.is_empty() {
            return Err(ApiError::forbidden(format!(
                "the dashboard reads, creates, changes and removes, so a login with a bearer \
                 token needs all of compute.read, compute.create, compute.modify and \
                 compute.cancel; this token lacks {}: get one with them (oidc-token --scope \
                 \"compute.read compute.create compute.modify compute.cancel\" ACCOUNT)",
                missing.join(", ")
            )));
        }
    }
    let token = random_token();
    let now = state.clock.now();
    let expires_at = (now + LINK_LIFETIME).min(caller.not_after);
    let identity = DashboardIdentity {
        dn: caller.user.dn.clone(),
        fqans: caller.fqans_text(),
        kind: caller.identity.kind,
        not_after: caller.not_after,
    };
    state
        .store
        .dashboard()
        .create_dashboard_link(&digest(&token), &identity, now, expires_at)
        .await?;
    tracing::info!(user = %caller.user.user_name, %expires_at, "Dashboard login link made.");
    let path = match next {
        Some(next) => format!("/dashboard/login?token={token}&next={}", next.query_value()),
        None => format!("/dashboard/login?token={token}"),
    };
    Ok(DashboardLink { path, expires_at })
}

/// The browser login whose cookie holds `cookie_token`, if it has not expired, with the
/// digest that names it.
pub async fn login_of(
    state: &AppState,
    cookie_token: &str,
) -> Result<Option<(String, DashboardLogin)>, ApiError> {
    let named = digest(cookie_token);
    let login = state
        .store
        .dashboard()
        .dashboard_login(&named, state.clock.now())
        .await?;
    Ok(login.map(|login| (named, login)))
}

/// The DN a login link's `token` was made for, while the link is unused and unexpired.
pub async fn link_owner(state: &AppState, token: &str) -> Result<Option<Dn>, ApiError> {
    let identity = state
        .store
        .dashboard()
        .dashboard_link(&digest(token), state.clock.now())
        .await?;
    Ok(identity.map(|identity| identity.dn))
}

/// A browser logged in: the token its cookie holds, and until when.
pub struct LoggedIn {
    pub cookie_token: String,
    pub expires_at: DateTime<Utc>,
}

/// Spends the login link's `token` for a browser login of `lifetime` (never past the
/// credential the link was made with); `None` when the link is used, expired or unknown.
pub async fn log_in(
    state: &AppState,
    token: &str,
    lifetime: TimeDelta,
) -> Result<Option<LoggedIn>, ApiError> {
    let now = state.clock.now();
    let Some(identity) = state
        .store
        .dashboard()
        .redeem_dashboard_link(&digest(token), now)
        .await?
    else {
        return Ok(None);
    };
    let expires_at = (now + lifetime).min(identity.not_after);
    let cookie_token = random_token();
    let login = DashboardLogin {
        identity,
        csrf_token: random_token(),
        expires_at,
    };
    state
        .store
        .dashboard()
        .create_dashboard_login(&digest(&cookie_token), &login, now)
        .await?;
    tracing::info!(user = ?login.identity.dn.as_str(), %expires_at, "Dashboard login.");
    Ok(Some(LoggedIn {
        cookie_token,
        expires_at,
    }))
}

/// Ends a browser's login (the dashboard's logout), named by its cookie's digest; the cookie
/// no longer logs in.
pub async fn log_out(state: &AppState, login: &str) -> Result<(), ApiError> {
    state.store.dashboard().end_dashboard_login(login).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_paths_under_the_dashboard_are_taken_as_sent() {
        for good in [
            "/dashboard/",
            "/dashboard/sessions/train1/apps/jupyter/",
            "/dashboard/sessions/train1/apps/port/8080/",
            "/dashboard/sessions/train1/apps/jupyter/lab/tree/a%20b.ipynb",
            "/dashboard/sessions/train1/apps/port/8080/?q=1&r=%2F#top",
            "/dashboard/sessions/train1/apps/jupyter/x..y/.hidden/",
        ] {
            let next = NextPath::parse(good).unwrap_or_else(|err| panic!("{good}: {err}"));
            assert_eq!(next.as_str(), good);
        }
        let longest = format!("/dashboard/{}", "a".repeat(NEXT_PATH_MAX - 11));
        assert!(NextPath::parse(&longest).is_ok());
    }

    #[test]
    fn next_paths_that_lead_elsewhere_are_refused_with_what_one_must_be() {
        for (bad, problem) in [
            ("", "does not start with /dashboard/"),
            ("//evil.test.invalid", "does not start with /dashboard/"),
            ("/\\evil.test.invalid", "does not start with /dashboard/"),
            ("https://x", "does not start with /dashboard/"),
            ("https://x/dashboard/", "does not start with /dashboard/"),
            ("javascript:alert(1)", "does not start with /dashboard/"),
            ("/dashboard", "does not start with /dashboard/"),
            ("/dashboardx/", "does not start with /dashboard/"),
            ("/v1/sessions", "does not start with /dashboard/"),
            ("dashboard/", "does not start with /dashboard/"),
            ("/dashboard//evil.test.invalid", "holds `//`"),
            ("/dashboard/x?u=//evil.test.invalid", "holds `//`"),
            ("/dashboard/\\evil.test.invalid", "holds a backslash"),
            ("/dashboard/../v1", "holds a `.` or `..` segment"),
            ("/dashboard/..", "holds a `.` or `..` segment"),
            ("/dashboard/./x", "holds a `.` or `..` segment"),
            ("/dashboard/%2e%2e/v1", "holds a `.` or `..` segment"),
            ("/dashboard/.%2E/v1", "holds a `.` or `..` segment"),
            ("/dashboard/x/..?a=b", "holds a `.` or `..` segment"),
            ("/dashboard/a b", "holds a space"),
            ("/dashboard/\n", "holds a space, a control character"),
            (
                "/dashboard/\r\nSet-Cookie:x=y",
                "holds a space, a control character",
            ),
            ("/dashboard/\u{7f}", "holds a space, a control character"),
            ("/dashboard/é", "non-ASCII"),
        ] {
            let err = NextPath::parse(bad).expect_err(bad).to_string();
            assert!(err.contains(problem), "{bad:?}: {err}");
            assert!(
                err.contains("a next path must be a path under /dashboard/"),
                "{bad:?}: {err}"
            );
        }
        let too_long = format!("/dashboard/{}", "a".repeat(NEXT_PATH_MAX - 10));
        let err = NextPath::parse(&too_long).unwrap_err().to_string();
        assert!(err.contains("longer than 1024 bytes"), "{err}");
    }

    #[test]
    fn a_next_path_in_a_query_keeps_its_slashes_and_encodes_the_rest() {
        let next = NextPath::parse("/dashboard/s/apps/port/8080/?a=1&b=%2F#x~y").unwrap();
        assert_eq!(
            next.query_value().to_string(),
            "/dashboard/s/apps/port/8080/%3Fa%3D1%26b%3D%252F%23x~y"
        );
    }
}
