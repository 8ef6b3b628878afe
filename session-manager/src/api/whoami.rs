//! `GET /v1/whoami`: the caller as the manager sees them (DN, login, UID, admin, credential,
//! accounting group; a bearer token's issuer, subject, groups and scopes). A caller the site does not admit gets the 403 that says what is needed.

use axum::Json;
use ongrid_core::api::{TokenInfo, WhoAmI};

use super::callers::CurrentUser;

pub async fn whoami(caller: CurrentUser) -> Json<WhoAmI> {
    let fqans = caller.fqans_text();
    Json(WhoAmI {
        dn: caller.user.dn,
        user_name: caller.user.user_name,
        uid: caller.user.uid,
        admin: caller.admin,
        credential: Some(caller.identity.kind),
        vos: caller.identity.vos,
        fqans,
        not_after: Some(caller.not_after),
        group: Some(caller.admitted.group.to_string()),
        admitted_by: Some(caller.admitted.rule),
        token: caller.identity.token.map(|token| TokenInfo {
            issuer: token.issuer,
            subject: token.subject,
            groups: token.groups.iter().map(ToString::to_string).collect(),
            scopes: token.scopes,
        }),
    })
}
