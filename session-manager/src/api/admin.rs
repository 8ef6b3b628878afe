//! Admin routes of the SSH gateway: the institutes allowlist (`devctl admin institute add | rm |
//! ls | show`) and the audit log of SSH connections (`devctl admin audit`).
//!
//! An institute is a name and at least one network; the gateway polls the list
//! (`GET /v1/gateway/allowlist`), so a change applies within its refresh interval. To change an
//! institute's networks, remove it and add it again. Adding and removing are
//! [`crate::app::institutes`], shared with the dashboard's admin forms.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use ongrid_core::api::AuditRecord;
use ongrid_core::{Dn, Institute, InstituteName};
use serde::Deserialize;

use super::callers::CurrentUser;
use super::{AdminJson, AdminQuery, ApiError, ApiPath, AppState};
use crate::app::gateway::parse_since;
use crate::app::institutes::{self, InstituteError};
use crate::app::Via;

/// The most audit records one answer carries.
pub const AUDIT_LIMIT: u32 = 1000;

fn institute_name(name: &str) -> Result<InstituteName, ApiError> {
    InstituteName::parse(name).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn no_institute(name: &InstituteName) -> ApiError {
    ApiError::not_found(format!(
        "no institute named {name}: list them with `devctl admin institute ls`"
    ))
}

pub async fn list_institutes(
    State(state): State<AppState>,
    caller: CurrentUser,
) -> Result<Json<Vec<Institute>>, ApiError> {
    Ok(Json(institutes::list(&state, &caller).await?))
}

pub async fn show_institute(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Institute>, ApiError> {
    caller.require_admin(institutes::MANAGE)?;
    let name = institute_name(&name)?;
    let institute = institutes::show(&state, &caller, &name)
        .await
        .map_err(refused)?;
    Ok(Json(institute))
}

/// The body of `POST /v1/institutes`: an [`Institute`], strictly. (`Institute` itself stays
/// lenient: the gateway reads it in the allowlist, across versions.)
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewInstitute {
    name: InstituteName,
    cidrs: Vec<ongrid_core::network::Cidr>,
}

pub async fn add_institute(
    State(state): State<AppState>,
    caller: CurrentUser,
    body: AdminJson<NewInstitute>,
) -> Result<(StatusCode, Json<Institute>), ApiError> {
    let body = body
        .parse(caller.require_admin(institutes::MANAGE)?)
        .await?;
    let institute = institutes::add(&state, &caller, body.name, &body.cidrs, Via::Api)
        .await
        .map_err(refused)?;
    Ok((StatusCode::CREATED, Json(institute)))
}

pub async fn remove_institute(
    State(state): State<AppState>,
    caller: CurrentUser,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Institute>, ApiError> {
    let removed = institutes::remove(&state, &caller, &name, Via::Api)
        .await
        .map_err(refused)?;
    Ok(Json(removed))
}

/// An institute action's refusal as the API words it, with the `devctl` command that helps.
fn refused(error: InstituteError) -> ApiError {
    match error {
        InstituteError::NeverMatches { error, .. } => {
            ApiError::bad_request(format!("cidrs: {error}"))
        }
        InstituteError::Exists(name) => ApiError::conflict(format!(
            "institute {name} already exists: to change its networks, remove it with \
             `devctl admin institute rm {name}` and add it again"
        )),
        InstituteError::NotFound(name) => no_institute(&name),
        InstituteError::Api(error) => error,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    user: Option<String>,
    since: Option<String>,
}

pub async fn audit(
    State(state): State<AppState>,
    caller: CurrentUser,
    query: AdminQuery<AuditQuery>,
) -> Result<Json<Vec<AuditRecord>>, ApiError> {
    let query = query.parse(caller.require_admin("read the audit log")?)?;
    let owner = query
        .user
        .as_deref()
        .map(|dn| Dn::parse(dn).map_err(|e| ApiError::bad_request(e.to_string())))
        .transpose()?;
    let since = query
        .since
        .as_deref()
        .map(|since| parse_since(since, state.clock.now()).map_err(ApiError::bad_request))
        .transpose()?;
    Ok(Json(
        crate::app::gateway::audit(&state, owner, since, AUDIT_LIMIT).await?,
    ))
}
