//! The institutes allowlist, for `POST` and `DELETE /v1/institutes` and the dashboard's admin
//! forms (admins only): an institute is a name and at least one network; the gateway polls the
//! list, so a change applies within its refresh interval.

use std::collections::BTreeSet;

use ongrid_core::network::{Cidr, CidrError};
use ongrid_core::{Institute, InstituteName};

use super::caller::CurrentUser;
use super::Via;
use super::{ApiError, AppState, Effect};
use crate::store::StoreError;

/// What admins may do with institutes, as [`CurrentUser::require_admin`] says it.
pub(crate) const MANAGE: &str = "manage institutes";

/// Why an institute was not added or removed, where the API and the dashboard give different
/// advice.
#[derive(Debug)]
pub enum InstituteError {
    /// A network that no address the gateway sees can match.
    NeverMatches { cidr: Cidr, error: CidrError },
    /// An institute of that name exists.
    Exists(InstituteName),
    /// No institute has that name.
    NotFound(InstituteName),
    /// Refused or failed alike for every caller: not an admin, a malformed name, the store.
    Api(ApiError),
}

impl From<ApiError> for InstituteError {
    fn from(error: ApiError) -> Self {
        Self::Api(error)
    }
}

impl From<StoreError> for InstituteError {
    fn from(error: StoreError) -> Self {
        Self::Api(error.into())
    }
}

/// Every institute (admins only).
pub async fn list(state: &AppState, caller: &CurrentUser) -> Result<Vec<Institute>, ApiError> {
    caller.require_admin(MANAGE)?;
    Ok(state.store.institutes().await?)
}

/// The institute named `name` (admins only).
pub async fn show(
    state: &AppState,
    caller: &CurrentUser,
    name: &InstituteName,
) -> Result<Institute, InstituteError> {
    caller.require_admin(MANAGE)?;
    state
        .store
        .institute(name)
        .await?
        .ok_or_else(|| InstituteError::NotFound(name.clone()))
}

/// Adds the institute `name` with `cidrs` (each once, in their order).
pub async fn add(
    state: &AppState,
    caller: &CurrentUser,
    name: InstituteName,
    cidrs: &[Cidr],
    via: Via,
) -> Result<Institute, InstituteError> {
    caller.require_admin(MANAGE)?;
    for &cidr in cidrs {
        cidr.check_matchable()
            .map_err(|error| InstituteError::NeverMatches { cidr, error })?;
    }
    if cidrs.is_empty() {
        return Err(ApiError::bad_request(format!(
            "institute {name} needs at least one network, like 192.0.2.0/24 or 2001:db8::/32"
        ))
        .into());
    }
    let mut seen = BTreeSet::new();
    let institute = Institute {
        cidrs: cidrs.iter().copied().filter(|c| seen.insert(*c)).collect(),
        name,
    };
    match state
        .store
        .add_institute(&institute, state.clock.now())
        .await
    {
        Ok(()) => {}
        Err(StoreError::InstituteExists(name)) => return Err(InstituteError::Exists(name)),
        Err(other) => return Err(other.into()),
    }
    let networks: Vec<String> = institute.cidrs.iter().map(ToString::to_string).collect();
    tracing::info!(institute = %institute.name, networks = %networks.join(" "), by = %caller.user.user_name, via = via.as_str(), "Institute added.");
    state.committed(&[Effect::People]);
    Ok(institute)
}

/// Removes the institute named `name`; returns it as it was.
pub async fn remove(
    state: &AppState,
    caller: &CurrentUser,
    name: &str,
    via: Via,
) -> Result<Institute, InstituteError> {
    caller.require_admin(MANAGE)?;
    let name = InstituteName::parse(name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let removed = state
        .store
        .remove_institute(&name)
        .await?
        .ok_or_else(|| InstituteError::NotFound(name.clone()))?;
    tracing::info!(institute = %name, by = %caller.user.user_name, via = via.as_str(), "Institute removed.");
    state.committed(&[Effect::People]);
    Ok(removed)
}
