//! The dashboard's pages (GET) and forms (POST). A page loads through [`super::data`] and
//! renders with [`super::views`]; a form checks the CSRF token, does its one action through
//! [`super::actions`] (the domain's rules, as the API applies them) and answers 303 back to the
//! page it came from, whose next view shows what it did once (a notice cookie). A refusal is an
//! HTML page with the status and the domain's words.

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Form;
use ongrid_core::api::CreateSession;
use ongrid_core::{Dn, SessionName};
use serde::Deserialize;

use super::actions::{self, Target};
use super::auth::{notice_cookie, redirect_with_cookie, AdminViewer, PageError, Viewer};
use super::data::{self, Live};
use super::views::{self, AuditFilterForm, Header, Page};
use crate::app::{gateway, ApiError, AppState};

fn header(viewer: &Viewer) -> Header<'_> {
    Header {
        user_name: viewer.caller.user.user_name.as_str(),
        dn: &viewer.caller.user.dn,
        admin: viewer.caller.admin,
        cookie_login: viewer.login.is_some(),
        csrf: &viewer.csrf,
        notice: viewer.notice.as_deref(),
    }
}

/// A page, clearing the notice it shows.
fn page(markup: maud::Markup, viewer: &Viewer) -> Response {
    let mut response = markup.into_response();
    if viewer.notice.is_some() {
        if let Ok(value) = super::auth::clear_cookie(super::auth::NOTICE_COOKIE).parse() {
            response
                .headers_mut()
                .append(axum::http::header::SET_COOKIE, value);
        }
    }
    response
}

/// `GET /dashboard/`: the viewer's sessions, images and jobs, and the forms.
pub async fn user_page(
    State(state): State<AppState>,
    viewer: Viewer,
) -> Result<Response, PageError> {
    let live = data::render(&state, &viewer, &Live::User).await?;
    let names = data::session_names(&state, &viewer).await?;
    Ok(page(
        views::user_page(&header(&viewer), live, &names),
        &viewer,
    ))
}

#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    #[serde(default)]
    user: String,
    #[serde(default)]
    since: String,
}

/// `GET /dashboard/admin[?user=DN&since=T]`: everything (admins only).
pub async fn admin_page(
    State(state): State<AppState>,
    viewer: Viewer,
    Query(query): Query<AuditQuery>,
) -> Result<Response, PageError> {
    viewer.require_admin()?;
    let user = Some(query.user.trim())
        .filter(|u| !u.is_empty())
        .map(|dn| Dn::parse(dn).map_err(|e| ApiError::bad_request(format!("user DN: {e}"))))
        .transpose()?;
    let since = Some(query.since.trim())
        .filter(|s| !s.is_empty())
        // Also when it reaches further back than any record: the page asks for a time.
        .map(|since| {
            gateway::parse_since(since, state.clock.now())
                .map_err(|_| ApiError::bad_request(gateway::since_unreadable(since)))
        })
        .transpose()?;
    let live = data::render(&state, &viewer, &Live::Admin).await?;
    let (institutes, audit) = data::admin_tables(&state, &viewer.caller, user, since).await?;
    let filter = AuditFilterForm {
        user: &query.user,
        since: &query.since,
    };
    Ok(page(
        views::admin_page(&header(&viewer), live, &institutes, &audit, &filter),
        &viewer,
    ))
}

/// `GET /dashboard/jobs/{id}`: a job's state and output.
pub async fn job_page(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let job_id = id
        .parse()
        .map_err(|_| PageError(ApiError::not_found(format!("you have no job {id}"))))?;
    let live = Live::Job(job_id);
    let job = data::job(&state, &viewer, job_id).await?;
    let markup = data::render(&state, &viewer, &live).await?;
    Ok(page(
        views::job_page(&header(&viewer), &job, markup),
        &viewer,
    ))
}

/// The answer to a form: back to `back` with the notice, or the refusal's page. The use case
/// behind the form woke whoever its change concerns ([`crate::app::Effect`]).
fn answer(back: Page, result: Result<String, ApiError>) -> Result<Response, PageError> {
    let notice = result?;
    Ok(redirect_with_cookie(back.path(), &notice_cookie(&notice)))
}

fn back(field: Option<&str>) -> Page {
    match field {
        Some("admin") => Page::Admin,
        _ => Page::User,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSessionForm {
    csrf: String,
    #[serde(default)]
    name: String,
    gpus: u32,
    #[serde(default)]
    min_memory: String,
    #[serde(default)]
    image: String,
}

/// `POST /dashboard/sessions`: a new session.
pub async fn new_session(
    State(state): State<AppState>,
    viewer: Viewer,
    Form(form): Form<NewSessionForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let name = Some(form.name.trim())
        .filter(|n| !n.is_empty())
        .map(|n| SessionName::parse(n).map_err(|e| ApiError::bad_request(format!("name: {e}"))))
        .transpose()?;
    let body = CreateSession {
        name,
        gpus: actions::gpu_request(form.gpus, &form.min_memory)?,
        image: Some(form.image.trim().to_owned()).filter(|i| !i.is_empty()),
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let result = actions::create_session(&state, &viewer.caller, body).await;
    answer(Page::User, result)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionForm {
    csrf: String,
    back: Option<String>,
    /// An admin acting on someone else's session.
    owner: Option<String>,
    /// Keep alive for this long.
    duration: Option<String>,
    /// An admin's reason for holding someone else's session.
    reason: Option<String>,
}

/// `POST /dashboard/sessions/{name}/{hold|release|keep|remove}`.
pub async fn session_action(
    State(state): State<AppState>,
    viewer: Viewer,
    Path((name, action)): Path<(String, String)>,
    Form(form): Form<SessionForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let owner = form
        .owner
        .as_deref()
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .map(|dn| Dn::parse(dn).map_err(|e| ApiError::bad_request(format!("owner: {e}"))))
        .transpose()?;
    let target = Target { name, owner };
    let caller = &viewer.caller;
    let result = match action.as_str() {
        "hold" => actions::hold(&state, caller, target, form.reason.as_deref()).await,
        "release" => actions::release(&state, caller, target).await,
        "keep" => {
            actions::keep(
                &state,
                caller,
                target,
                form.duration.as_deref().unwrap_or("4h"),
            )
            .await
        }
        "remove" => actions::remove(&state, caller, target).await,
        other => Err(ApiError::not_found(format!(
            "a session has no action {other:?}: hold, release, keep or remove"
        ))),
    };
    answer(back(form.back.as_deref()), result)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeForm {
    csrf: String,
    session: String,
    tag: String,
    #[serde(default)]
    force: Option<String>,
}

/// `POST /dashboard/freeze`.
pub async fn freeze(
    State(state): State<AppState>,
    viewer: Viewer,
    Form(form): Form<FreezeForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let force = form.force.as_deref() == Some("true");
    let result = actions::freeze(&state, &viewer.caller, &form.session, &form.tag, force).await;
    answer(Page::User, result)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsrfBackForm {
    csrf: String,
    back: Option<String>,
}

/// `POST /dashboard/jobs/{id}/cancel`.
pub async fn cancel_job(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
    Form(form): Form<CsrfBackForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let result = actions::cancel_job(&state, &viewer.caller, &id).await;
    answer(back(form.back.as_deref()), result)
}

/// `POST /dashboard/jobs/{id}/remove`.
pub async fn remove_job(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(id): Path<String>,
    Form(form): Form<CsrfBackForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let result = actions::remove_job(&state, &viewer.caller, &id).await;
    answer(back(form.back.as_deref()), result)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstituteForm {
    csrf: String,
    name: String,
    networks: String,
}

/// `POST /dashboard/admin/institutes` (admins only, like every admin form).
pub async fn add_institute(
    State(state): State<AppState>,
    AdminViewer(viewer): AdminViewer,
    Form(form): Form<InstituteForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let result = actions::add_institute(&state, &viewer.caller, &form.name, &form.networks).await;
    answer(Page::Admin, result)
}

/// `POST /dashboard/admin/institutes/{name}/remove`.
pub async fn remove_institute(
    State(state): State<AppState>,
    AdminViewer(viewer): AdminViewer,
    Path(name): Path<String>,
    Form(form): Form<CsrfBackForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let result = actions::remove_institute(&state, &viewer.caller, &name).await;
    answer(Page::Admin, result)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainForm {
    csrf: String,
    #[serde(default)]
    reason: String,
}

fn drain_reason<'a>(action: &str, form: &'a DrainForm) -> Result<Option<&'a str>, ApiError> {
    match action {
        "drain" => Ok(Some(form.reason.as_str())),
        "undrain" => Ok(None),
        other => Err(ApiError::not_found(format!(
            "no action {other:?}: drain or undrain"
        ))),
    }
}

/// `POST /dashboard/admin/nodes/{name}/{drain|undrain}`.
pub async fn node_drain(
    State(state): State<AppState>,
    AdminViewer(viewer): AdminViewer,
    Path((name, action)): Path<(String, String)>,
    Form(form): Form<DrainForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let reason = drain_reason(&action, &form)?;
    let result = actions::drain_node(&state, &viewer.caller, &name, reason).await;
    answer(Page::Admin, result)
}

/// `POST /dashboard/admin/gpus/{uuid}/{drain|undrain}`.
pub async fn gpu_drain(
    State(state): State<AppState>,
    AdminViewer(viewer): AdminViewer,
    Path((uuid, action)): Path<(String, String)>,
    Form(form): Form<DrainForm>,
) -> Result<Response, PageError> {
    viewer.check_csrf(&form.csrf)?;
    let reason = drain_reason(&action, &form)?;
    let result = actions::drain_gpu(&state, &viewer.caller, &uuid, reason).await;
    answer(Page::Admin, result)
}
