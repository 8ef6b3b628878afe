//! Who is looking at the dashboard, and the checks on what they send.
//!
//! Two ways in, both ending in the same [`CurrentUser`] the API uses, so a browser sees and
//! changes exactly what devctl would:
//! - a login link: `devctl dashboard` calls `POST /v1/dashboard/links`
//!   ([`crate::app::logins::create_link`]) with the user's grid credential; the link's token is
//!   good once, for [`crate::app::logins::LINK_LIFETIME`]. Opening it
//!   shows a button ([`login_page`]) whose POST ([`log_in`]) spends the token and sets the
//!   browser's login cookie [`COOKIE]` (`HttpOnly; Secure; SameSite=Strict`), valid for
//!   [`LOGIN_LIFETIME`] or until the credential expires, whichever is first. The button keeps
//!   link previews and prefetches from spending the token. A link may carry a page to land on
//!   (`&next=`, like a session's JupyterLab): the page's form carries it, and the login
//!   redirects there; both check it again ([`NextPath::parse`]), never trusting the query.
//! - the browser's own client certificate, verified in the TLS handshake exactly as devctl's.
//!
//! Only SHA-256 digests of tokens are stored. Every state-changing form carries the login's CSRF
//! token ([`Viewer::check_csrf`]); with a certificate, the token is an HMAC-like digest of the
//! DN under a per-process secret. POSTs from another origin are refused before that
//! ([`same_origin`]).

use std::sync::OnceLock;

use axum::extract::{FromRequestParts, Query, State};
use axum::http::header::{COOKIE as COOKIE_HEADER, HOST, LOCATION, ORIGIN, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Form;
use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::Dn;
use ongrid_x509::voms::Fqan;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::views;
use crate::app::caller::CurrentUser;
use crate::app::error::{CallerSlot, Refused};
use crate::app::logins::{self, random_token, LoggedIn, NextPath};
use crate::app::{ApiError, AppState};
use crate::grid_identity::Identity;
use crate::grid_identity::Peer;

/// How long a browser stays logged in (never past the credential's end).
pub const LOGIN_LIFETIME: TimeDelta = TimeDelta::hours(12);
/// The login cookie.
pub const COOKIE: &str = "ongrid_dashboard";
/// The one-shot notice cookie: what the last form did, shown once.
pub const NOTICE_COOKIE: &str = "ongrid_notice";

/// Constant-time equality of two tokens.
fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The CSRF token of a browser that logs in with its certificate: a digest of its DN under a
/// secret made at start-up (such forms stop working when the manager restarts; a reload fixes
/// that).
fn certificate_csrf(dn: &str) -> String {
    static SECRET: OnceLock<String> = OnceLock::new();
    let secret = SECRET.get_or_init(random_token);
    hex::encode(Sha256::digest(format!("{secret}\n{dn}").as_bytes()))
}

/// An answer of the dashboard that is not the page asked for: an HTML page with the status and
/// what to do. A 401 says how to log in.
#[derive(Debug)]
pub struct PageError(pub ApiError);

impl From<ApiError> for PageError {
    fn from(error: ApiError) -> Self {
        Self(error)
    }
}

impl From<crate::store::StoreError> for PageError {
    fn from(error: crate::store::StoreError) -> Self {
        Self(error.into())
    }
}

impl From<crate::domain::Refusal> for PageError {
    fn from(refusal: crate::domain::Refusal) -> Self {
        Self(refusal.into())
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        let page = if status == StatusCode::UNAUTHORIZED {
            views::logged_out(self.0.message())
        } else {
            views::error_page(status, self.0.message())
        };
        let mut response = (status, page).into_response();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            // Logged once, with the caller, the address and the path, by `log_refusals`.
            response
                .extensions_mut()
                .insert(Refused(self.0.message().to_owned()));
        }
        response
    }
}

/// The person behind a dashboard request.
#[derive(Debug, Clone)]
pub struct Viewer {
    /// Exactly what the API's extractor makes for a certificate: the same checks follow.
    pub caller: CurrentUser,
    /// The token this login's forms must carry.
    pub csrf: String,
    /// The digest of the login cookie; `None` when the browser presented a certificate.
    pub login: Option<String>,
    /// A notice left by the last form (shown once).
    pub notice: Option<String>,
}

/// The value of cookie `name` in the request.
fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE_HEADER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

impl FromRequestParts<AppState> for Viewer {
    type Rejection = PageError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, PageError> {
        let notice = cookie(&parts.headers, NOTICE_COOKIE)
            .and_then(|hex_text| hex::decode(hex_text).ok())
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .filter(|text| !text.is_empty());
        if let Some(token) = cookie(&parts.headers, COOKIE) {
            if let Some((login_digest, login)) = logins::login_of(state, token).await? {
                if let Some(slot) = parts.extensions.get::<CallerSlot>() {
                    slot.set(&login.identity.dn);
                }
                same_person(presented_dn(parts).as_ref(), &login.identity.dn)?;
                let identity = Identity {
                    dn: login.identity.dn.clone(),
                    kind: login.identity.kind,
                    vos: Vec::new(),
                    fqans: login
                        .identity
                        .fqans
                        .iter()
                        .filter_map(|fqan| Fqan::parse(fqan).ok())
                        .collect(),
                    not_after: login.expires_at,
                    token: None,
                };
                let caller = CurrentUser::for_identity(state, &identity).await?;
                return Ok(Self {
                    caller,
                    csrf: login.csrf_token,
                    login: Some(login_digest),
                    notice,
                });
            }
        }
        let identity = parts
            .extensions
            .get::<Peer>()
            .and_then(|peer| peer.identity.as_ref())
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    "you are not logged in (or your login expired): run `devctl dashboard` and \
                     open the link it prints, or present your grid certificate to the browser",
                )
            })?;
        let caller = CurrentUser::for_identity(state, identity).await?;
        let csrf = certificate_csrf(caller.user.dn.as_str());
        Ok(Self {
            caller,
            csrf,
            login: None,
            notice,
        })
    }
}

impl Viewer {
    /// Refuses a form that does not carry this login's CSRF token.
    pub fn check_csrf(&self, sent: &str) -> Result<(), PageError> {
        if same_token(sent, &self.csrf) {
            Ok(())
        } else {
            Err(PageError(ApiError::forbidden(
                "this form is not from your current dashboard page (its CSRF token does not \
                 match): reload the page and try again",
            )))
        }
    }

    /// Refuses a non-admin.
    pub fn require_admin(&self) -> Result<(), PageError> {
        self.caller
            .require_admin("see the admin pages")
            .map(|_admin| ())
            .map_err(PageError)
    }
}

/// A viewer who is an admin: the admin forms take it, so a user is refused (403, "only admins")
/// before the form is read, whatever it holds, as the API's admin routes do.
#[derive(Debug, Clone)]
pub struct AdminViewer(pub Viewer);

impl FromRequestParts<AppState> for AdminViewer {
    type Rejection = PageError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, PageError> {
        let viewer = Viewer::from_request_parts(parts, state).await?;
        viewer.require_admin()?;
        Ok(Self(viewer))
    }
}

/// Refuses a POST whose `Origin` is not this manager (defence in depth beside the CSRF token
/// and `SameSite=Strict`; browsers send `Origin` on every POST).
pub async fn same_origin(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if request.method() == Method::POST {
        let host = request
            .headers()
            .get(HOST)
            .and_then(|v| v.to_str().ok())
            .or_else(|| request.uri().authority().map(|a| a.as_str()))
            .unwrap_or_default()
            .to_owned();
        let origin = request.headers().get(ORIGIN).and_then(|v| v.to_str().ok());
        if let Some(origin) = origin {
            if origin != format!("https://{host}") {
                return PageError(ApiError::forbidden(format!(
                    "a form sent from {origin} may not change anything here: use the \
                     dashboard's own pages"
                )))
                .into_response();
            }
        }
    }
    next.run(request).await
}

#[derive(Debug, Deserialize)]
pub struct TokenQuery {
    #[serde(default)]
    token: String,
    /// Where the browser goes once logged in (checked by [`next_page`]).
    #[serde(default)]
    next: Option<String>,
}

/// The page a login lands on: `next` when it is a page of the dashboard, a 400 page saying what
/// it must be otherwise.
fn next_page(next: Option<&str>) -> Result<Option<NextPath>, PageError> {
    next.map(NextPath::parse)
        .transpose()
        .map_err(|err| PageError(ApiError::bad_request(err.to_string())))
}

fn spent_link() -> PageError {
    PageError(ApiError::unauthenticated(
        "this login link was used already or has expired (links last 5 minutes and work \
         once): run `devctl dashboard` again",
    ))
}

/// `GET /dashboard/login?token=...[&next=PATH]`: a button that logs in (the token is not spent
/// yet), and then goes to `next`.
pub async fn login_page(
    State(state): State<AppState>,
    Query(query): Query<TokenQuery>,
) -> Result<Response, PageError> {
    let next = next_page(query.next.as_deref())?;
    let owner = logins::link_owner(&state, &query.token)
        .await?
        .ok_or_else(spent_link)?;
    Ok(views::login_page(&owner, &query.token, next.as_ref()).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoginForm {
    token: String,
    /// The link's next page, carried by the login page (checked again by [`next_page`]).
    #[serde(default)]
    next: Option<String>,
}

/// The DN of the client certificate the browser presented on this connection, if any.
#[derive(Debug, Clone)]
pub struct PresentedCertificate(pub Option<Dn>);

impl FromRequestParts<AppState> for PresentedCertificate {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, Self::Rejection> {
        Ok(Self(presented_dn(parts)))
    }
}

fn presented_dn(parts: &Parts) -> Option<Dn> {
    parts
        .extensions
        .get::<Peer>()
        .and_then(|peer| peer.identity.as_ref())
        .map(|identity| identity.dn.clone())
}

/// A login (or a link) is bound to the DN it was made for: a browser that presents the
/// certificate of someone else is refused, so one person's link or cookie never acts under
/// another's certificate (login CSRF, or two identities in one request).
fn same_person(certificate: Option<&Dn>, login: &Dn) -> Result<(), ApiError> {
    match certificate {
        Some(dn) if dn != login => Err(ApiError::forbidden(format!(
            "this login is {login}'s, but the browser presents the certificate of {dn}: log out \
             and use the certificate, or use the login in a browser without that certificate"
        ))),
        _ => Ok(()),
    }
}

/// `POST /dashboard/login`: spends the link's token, sets the login cookie and redirects to the
/// form's next page (else the front page). A browser that presents another person's
/// certificate, or a next page off the dashboard, is refused before the token is spent.
pub async fn log_in(
    State(state): State<AppState>,
    PresentedCertificate(certificate): PresentedCertificate,
    Form(form): Form<LoginForm>,
) -> Result<Response, PageError> {
    let next = next_page(form.next.as_deref())?;
    if let Some(certificate) = &certificate {
        let owner = logins::link_owner(&state, &form.token)
            .await?
            .ok_or_else(spent_link)?;
        same_person(Some(certificate), &owner)?;
    }
    let LoggedIn {
        cookie_token,
        expires_at,
    } = logins::log_in(&state, &form.token, LOGIN_LIFETIME)
        .await?
        .ok_or_else(spent_link)?;
    Ok(redirect_with_cookie(
        next.as_ref().map_or("/dashboard/", NextPath::as_str),
        &login_cookie(&cookie_token, expires_at, state.clock.now()),
    ))
}

/// `Set-Cookie` for a login that lasts until `expires_at`.
pub fn login_cookie(token: &str, expires_at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let max_age = (expires_at - now).num_seconds().max(0);
    format!(
        "{COOKIE}={token}; Path=/dashboard; Max-Age={max_age}; HttpOnly; Secure; SameSite=Strict"
    )
}

/// `Set-Cookie` for a notice shown once by the next page.
pub fn notice_cookie(text: &str) -> String {
    format!(
        "{NOTICE_COOKIE}={}; Path=/dashboard; Max-Age=60; HttpOnly; Secure; SameSite=Strict",
        hex::encode(text.as_bytes())
    )
}

/// `Set-Cookie` that clears cookie `name`.
pub fn clear_cookie(name: &str) -> String {
    format!("{name}=; Path=/dashboard; Max-Age=0; HttpOnly; Secure; SameSite=Strict")
}

/// 303 to `location`, setting `cookie`.
pub fn redirect_with_cookie(location: &str, cookie: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(location) {
        headers.insert(LOCATION, value);
    }
    if let Ok(value) = HeaderValue::from_str(cookie) {
        headers.append(SET_COOKIE, value);
    }
    response
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsrfForm {
    csrf: String,
}

/// `POST /dashboard/logout`: ends the cookie's login.
pub async fn log_out(
    State(state): State<AppState>,
    viewer: Viewer,
    Form(form): Form<CsrfForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    if let Some(login) = &viewer.login {
        crate::app::logins::log_out(&state, login).await?;
    }
    Ok(redirect_with_cookie("/dashboard/", &clear_cookie(COOKIE)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_long_random_and_compared_whole() {
        let a = random_token();
        let b = random_token();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(same_token(&a, &a.clone()));
        assert!(!same_token(&a, &b));
        assert!(!same_token(&a, &a[..63]));
        assert!(!same_token("", &a));
        assert_eq!(logins::digest("x").len(), 64);
        assert_ne!(logins::digest(&a), a);
    }

    #[test]
    fn the_login_cookie_is_http_only_secure_strict_and_expires() {
        let now = Utc::now();
        let cookie = login_cookie("abc", now + TimeDelta::hours(2), now);
        assert_eq!(
            cookie,
            "ongrid_dashboard=abc; Path=/dashboard; Max-Age=7200; HttpOnly; Secure; SameSite=Strict"
        );
    }

    #[test]
    fn cookies_are_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            COOKIE_HEADER,
            HeaderValue::from_static("a=1; ongrid_dashboard=tok; b=2"),
        );
        assert_eq!(cookie(&headers, COOKIE), Some("tok"));
        assert_eq!(cookie(&headers, "c"), None);
    }

    #[test]
    fn certificate_csrf_tokens_differ_per_user() {
        assert_eq!(certificate_csrf("/CN=a"), certificate_csrf("/CN=a"));
        assert_ne!(certificate_csrf("/CN=a"), certificate_csrf("/CN=b"));
    }
}
