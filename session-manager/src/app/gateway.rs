//! What the SSH gateway asks of the manager (through [`crate::api`]'s routes, with the bearer
//! token of `gateway_token_file`): the allowlist it polls,
//! whose key a client offers, which session an SSH user name reaches, the connection events
//! that feed the audit log and move sessions between WAITING, CONNECTED and IDLE (as
//! [`crate::domain::sessions::connections`] decides, inside the store's transaction), and which
//! keys of its open connections were removed or expired since (the gateway asks every second
//! and closes those connections with the message).
//!
//! A login re-checks the site's `[policy]` admission ([`login_refusal`]) with the VOMS
//! attributes of the credential the key was registered with: a user the site no longer admits
//! (the policy changed since) cannot open an SSH session, and is told which VO or contact they
//! need, as the API tells them.
//!
//! The manager words every refusal here; the gateway shows the message to the SSH client as it
//! is. Routing considers only the key owner's own sessions, so another user's session is never
//! reachable, whatever the name.

use chrono::{DateTime, Utc};
use ongrid_core::api::{
    Allowlist, AuditRecord, ConnectionEvent, ConnectionEventKind, HeldKey, HeldKeys, KeyCheck,
    KeyOwner, Revocation, RevokedKey, RevokedKeys, Route, RouteRequest,
};
use ongrid_core::holds::SessionDeadlines;
use ongrid_core::{Dn, HumanDuration, SessionName, SessionState};

use super::views::deadlines_view;
use super::{ApiError, AppState, Effect};
use crate::auth::Admins;
use crate::domain::policy::Admission;
use crate::domain::sessions::SessionRecord;
use crate::domain::users::{self, Removed};
use crate::domain::utc;
use crate::keys::fingerprint_of;
use crate::store::{AuditFilter, KeyRecord, SessionFilter, StoreError};

/// The most keys one check may ask about (a gateway's distinct keys of open connections).
pub const MAX_HELD_KEYS: usize = 10_000;

/// The institutes whose networks may connect.
pub async fn allowlist(state: &AppState) -> Result<Allowlist, ApiError> {
    Ok(Allowlist {
        institutes: state.store.institutes().await?,
    })
}

/// Whose key a client offers: its owner when the key is registered, unexpired, and the site's
/// policy still admits the owner; else why not, worded for the SSH client.
pub async fn authorize(state: &AppState, check: KeyCheck) -> Result<KeyOwner, ApiError> {
    let fingerprint = fingerprint_of(&check.public_key)
        .map_err(|e| ApiError::bad_request(format!("the offered key cannot be read: {e}")))?;
    let Some(key) = state.store.key(&fingerprint).await? else {
        // Debug: a client with several keys in its agent offers them in turn.
        tracing::debug!(source = %check.source, login = ?check.login, %fingerprint, "SSH key refused: not registered.");
        return Err(ApiError::unauthenticated(format!(
            "key {fingerprint} is not registered: add it with `devctl key add`"
        ))
        .already_logged());
    };
    if key.expires_at <= state.clock.now() {
        // The login name is the client's, unchecked: `?` escapes it, so it cannot forge a line.
        tracing::info!(source = %check.source, login = ?check.login, %fingerprint, user = %key.user_name, expired_at = %key.expires_at, "SSH key refused: expired.");
        return Err(ApiError::unauthenticated(format!(
            "key {fingerprint} expired at {} with {}",
            utc(key.expires_at),
            renewal(&key)
        ))
        .already_logged());
    }
    if let Some(message) = login_refusal(&state.config.admission, &state.config.admins, &key) {
        tracing::info!(source = %check.source, login = ?check.login, %fingerprint, user = %key.user_name, owner = %key.owner, "SSH key refused: the site's policy does not admit its owner.");
        return Err(ApiError::forbidden(message).already_logged());
    }
    tracing::debug!(source = %check.source, login = ?check.login, %fingerprint, user = %key.user_name, "SSH key accepted.");
    Ok(KeyOwner {
        owner: key.owner,
        user_name: key.user_name,
        fingerprint: key.fingerprint,
        expires_at: key.expires_at,
    })
}

/// Why the site's `[policy]` no longer lets the owner of `key` log in, judged on the verified
/// FQANs of the credential the key was (last) registered with, as the API judges a
/// certificate; `None` when it does. A key registered before the store kept FQANs is judged as
/// showing none, and the message says to register it again.
pub fn login_refusal(admission: &Admission, admins: &Admins, key: &KeyRecord) -> Option<String> {
    let fqans: Vec<ongrid_x509::voms::Fqan> = key
        .fqans
        .iter()
        .flatten()
        .filter_map(|fqan| ongrid_x509::voms::Fqan::parse(fqan).ok())
        .collect();
    let admin = admins.admits(&key.owner, &fqans);
    let refusal = match key.token_issuer {
        Some(_) => admission.admit_token(&key.owner, &fqans, admin),
        None => admission.admit(&key.owner, &fqans, admin),
    }
    .err()?;
    let mut message = format!(
        "SSH key {} cannot log in: {refusal} (judged on the credential the key was registered \
         with)",
        key.fingerprint
    );
    if key.fqans.is_none() {
        message.push_str(
            "; the key was registered before this site kept VOMS attributes: if your VO admits \
             you, run `devctl key add` again with a VOMS proxy",
        );
    }
    Some(message)
}

/// Which of the keys of the gateway's open connections no longer let their owner in: removed
/// (or registered to someone else now), or expired. The others are left out of the answer.
pub async fn check_keys(state: &AppState, held: HeldKeys) -> Result<RevokedKeys, ApiError> {
    if held.keys.len() > MAX_HELD_KEYS {
        return Err(ApiError::bad_request(format!(
            "keys: at most {MAX_HELD_KEYS} keys per check, not {}",
            held.keys.len()
        )));
    }
    let now = state.clock.now();
    let mut revoked = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for key in held.keys {
        if !seen.insert(key.clone()) {
            continue;
        }
        let record = state.store.key(&key.fingerprint).await?;
        let owner = match &record {
            Some(record) if record.owner == key.owner => None,
            _ => state.store.existing_user(&key.owner).await?,
        };
        let removed = owner.as_ref().and_then(|user| user.removed.as_ref());
        if let Some(revocation) = revocation(key, record.as_ref(), removed, now) {
            tracing::info!(fingerprint = ?revocation.key.fingerprint, owner = %revocation.key.owner,
                why = ?revocation.why, "SSH key of open connections no longer valid: the gateway closes them.");
            revoked.push(revocation);
        }
    }
    Ok(RevokedKeys { revoked })
}

/// What an expired key was registered with, and how to renew it.
fn renewal(key: &KeyRecord) -> String {
    match &key.token_issuer {
        Some(issuer) => format!(
            "the bearer token ({issuer}) it was registered with: get a new token (oidc-token \
             ACCOUNT, or htgettoken) and run `devctl key add` again"
        ),
        None => "the proxy or certificate it was registered with: renew your proxy \
                 (voms-proxy-init) and run `devctl key add` again"
            .to_owned(),
    }
}

/// Whether `key`, held by an open connection, still lets its owner in, as `record` (the key's
/// registration now, if any) says at `now`; the revocation with the user's message if not.
/// `removed`: the owner's removal by an admin, which took the key with it (adding a key again
/// would not help them, so the message says what would).
pub fn revocation(
    key: HeldKey,
    record: Option<&KeyRecord>,
    removed: Option<&Removed>,
    now: DateTime<Utc>,
) -> Option<RevokedKey> {
    match record {
        Some(record) if record.owner == key.owner && record.expires_at > now => None,
        Some(record) if record.owner == key.owner => {
            let at = record.expires_at;
            let message = format!(
                "your SSH key {} expired at {} with {}",
                key.fingerprint,
                utc(at),
                renewal(record)
            );
            Some(RevokedKey {
                key,
                why: Revocation::Expired,
                at,
                message,
            })
        }
        _ => {
            let message = match removed {
                Some(removed) => users::removal_message(&key.owner, removed),
                None => format!(
                    "your SSH key {} was removed at {}: run `devctl key add` to register a key \
                     again",
                    key.fingerprint,
                    utc(now)
                ),
            };
            Some(RevokedKey {
                key,
                why: Revocation::Removed,
                at: now,
                message,
            })
        }
    }
}

/// Where an SSH login of the key's owner goes: the session its user name chooses
/// ([`choose`]), when that session runs ([`reachable`]).
pub async fn route(state: &AppState, request: RouteRequest) -> Result<Route, ApiError> {
    let sessions = state
        .store
        .sessions(SessionFilter::Owner(request.owner.clone()))
        .await?;
    let session = choose(&sessions, &request.target)?;
    let queue_position = state.queue_position(session).await?;
    let agent_url = match &session.node {
        Some(node) if session.state.holds_gpus() => super::lookup::stream_url(state, node).await?,
        _ => None,
    };
    let route = reachable(session, queue_position, agent_url)?;
    tracing::debug!(owner = %request.owner, target = ?request.target, session = %route.session_name, node = %route.node, "SSH route.");
    Ok(route)
}

/// The session an SSH user name reaches among the owner's sessions that have not ended: the one
/// of that name; else the only one that is live or HELD; else, when the owner has exactly one
/// session (FAILED), that one, so that its state is explained. Several or none: 404 saying what
/// to do.
pub fn choose<'a>(
    sessions: &'a [SessionRecord],
    target: &str,
) -> Result<&'a SessionRecord, ApiError> {
    if let Ok(name) = SessionName::parse(target) {
        if let Some(session) = sessions.iter().find(|s| s.name == name) {
            return Ok(session);
        }
    }
    let candidates: Vec<&SessionRecord> = sessions
        .iter()
        .filter(|s| s.state.is_live() || s.state == SessionState::Held)
        .collect();
    match (candidates.as_slice(), sessions) {
        ([only], _) => Ok(only),
        ([], []) => Err(ApiError::not_found(
            "you have no session: start one with `devctl session new`",
        )),
        ([], [only]) => Ok(only),
        _ => {
            let listed: Vec<String> = sessions
                .iter()
                .map(|s| format!("{} {}", s.name, s.state))
                .collect();
            Err(ApiError::not_found(format!(
                "you have several sessions ({}): connect with ssh <name>@<this gateway>",
                listed.join(", ")
            )))
        }
    }
}

/// The route to `session` when it runs and its node's agent has a stream endpoint, else 409
/// with its state and what to do.
pub fn reachable(
    session: &SessionRecord,
    queue_position: Option<u32>,
    agent_url: Option<String>,
) -> Result<Route, ApiError> {
    let name = &session.name;
    match session.state {
        SessionState::Waiting | SessionState::Connected | SessionState::Idle => {
            let node = session.node.clone().ok_or_else(|| {
                ApiError::internal(format!("running session {} has no node", session.id))
            })?;
            let agent_url = agent_url.ok_or_else(|| {
                ApiError::conflict(format!(
                    "session {name} runs on node {node}, whose agent has no [streams] \
                     configured, so SSH cannot reach it: ask your site admin to enable streams \
                     on {node}"
                ))
            })?;
            Ok(Route {
                session_id: session.id,
                session_name: name.clone(),
                state: session.state,
                node,
                container: session.id.container_name(),
                agent_url,
            })
        }
        SessionState::Pending => {
            let position = queue_position
                .map(|n| format!(", number {n} in the queue"))
                .unwrap_or_default();
            Err(ApiError::conflict(format!(
                "session {name} is PENDING{position}: it starts once the scheduler gives it \
                 a GPU (devctl session show {name})"
            )))
        }
        SessionState::Starting => Err(ApiError::conflict(format!(
            "session {name} is starting: try again in a few seconds"
        ))),
        SessionState::Held => Err(ApiError::conflict(format!(
            "session {name} is HELD ({}): run `devctl session release {name}`",
            session.reason
        ))),
        // Reasons that say what to do already (a lost node, a failed GPU) are not told twice.
        SessionState::Failed if session.reason.contains("devctl session rm") => Err(
            ApiError::conflict(format!("session {name} FAILED: {}", session.reason)),
        ),
        SessionState::Failed => Err(ApiError::conflict(format!(
            "session {name} FAILED ({}): remove it with `devctl session rm {name}` and start a \
             new one",
            session.reason
        ))),
        SessionState::Ended => Err(ApiError::not_found(format!(
            "session {name} has ended: start a new one with `devctl session new`"
        ))),
    }
}

/// The audit log of SSH connections, newest first: of the user `owner` (everyone's when
/// `None`), since `since`, at most `limit` records. Admins only; checked by the caller.
pub async fn audit(
    state: &AppState,
    owner: Option<Dn>,
    since: Option<DateTime<Utc>>,
    limit: u32,
) -> Result<Vec<AuditRecord>, ApiError> {
    let filter = AuditFilter {
        owner,
        since,
        limit,
    };
    Ok(state.store.audit(filter).await?)
}

/// `since` as a time (RFC 3339) or as a duration before `now` (`2 hours`, `3d`).
pub fn parse_since(value: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let value = value.trim();
    if let Ok(time) = DateTime::parse_from_rfc3339(value) {
        return Ok(time.with_timezone(&Utc));
    }
    let ago = HumanDuration::parse(value)
        .map_err(|_| since_unreadable(value))?
        .as_duration();
    chrono::TimeDelta::from_std(ago)
        .ok()
        .and_then(|ago| now.checked_sub_signed(ago))
        .ok_or_else(|| format!("since {value:?} reaches further back than any record"))
}

/// What a `since` that is neither a time nor a duration must look like.
pub fn since_unreadable(value: &str) -> String {
    format!(
        "since {value:?} must be a time like 2026-05-01T10:00:00Z or a duration ago like \
         \"2 hours\""
    )
}

/// Records an SSH connection's opening, activity or closing (which may move its session
/// between WAITING, CONNECTED and IDLE) and answers with the session's deadlines, which the
/// gateway shows its users.
pub async fn connection_event(
    state: &AppState,
    event: ConnectionEvent,
) -> Result<SessionDeadlines, ApiError> {
    let session = state
        .store
        .session(event.session_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no session with id {}", event.session_id)))?;
    if session.owner != event.owner {
        return Err(ApiError::bad_request(format!(
            "session {} belongs to {}, not to {}",
            event.session_id, session.owner, event.owner
        )));
    }
    let recorded = match state
        .store
        .record_connection(&event, state.clock.now())
        .await
    {
        Ok(recorded) => recorded,
        Err(StoreError::NoSuchSession(id)) => {
            return Err(ApiError::not_found(format!("no session with id {id}")))
        }
        Err(other) => return Err(other.into()),
    };
    let kind = match event.event {
        ConnectionEventKind::Open => "open",
        ConnectionEventKind::Close => "close",
        ConnectionEventKind::Activity => {
            tracing::debug!(connection = %event.connection_id, session = %recorded.session.name,
                bytes_in = event.bytes_in, bytes_out = event.bytes_out, "SSH connection activity.");
            if recorded.transition.is_some() {
                state.committed(&[Effect::People]);
            }
            return deadlines_view(state, &recorded.session).await;
        }
    };
    // A session's connections and state (WAITING, CONNECTED, IDLE); no node's desired state.
    state.committed(&[Effect::People]);
    tracing::info!(
        connection = %event.connection_id,
        event = kind,
        user = %recorded.session.user_name,
        session = %recorded.session.name,
        source = %event.source,
        institute = %event.institute,
        fingerprint = ?event.fingerprint,
        bytes_in = event.bytes_in,
        bytes_out = event.bytes_out,
        open = recorded.open_connections,
        state = %recorded.session.state,
        "SSH connection event."
    );
    deadlines_view(state, &recorded.session).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::sessions::fixtures::session;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    #[test]
    fn since_is_a_time_or_a_duration_ago() {
        use chrono::TimeZone;
        let now = Utc.with_ymd_and_hms(2026, 5, 1, 12, 0, 0).unwrap();
        assert_eq!(
            parse_since("2026-05-01T10:00:00Z", now).unwrap(),
            Utc.with_ymd_and_hms(2026, 5, 1, 10, 0, 0).unwrap()
        );
        assert_eq!(
            parse_since("2026-05-01T12:00:00+02:00", now).unwrap(),
            Utc.with_ymd_and_hms(2026, 5, 1, 10, 0, 0).unwrap()
        );
        assert_eq!(
            parse_since("2 hours", now).unwrap(),
            Utc.with_ymd_and_hms(2026, 5, 1, 10, 0, 0).unwrap()
        );
        assert_eq!(
            parse_since("1d", now).unwrap(),
            Utc.with_ymd_and_hms(2026, 4, 30, 12, 0, 0).unwrap()
        );
        let err = parse_since("yesterday", now).unwrap_err();
        assert!(err.contains("2 hours"), "{err}");
        assert!(parse_since("99999999999 weeks", now).is_err());
    }

    fn message(error: ApiError) -> (StatusCode, String) {
        (error.status(), error.message().to_owned())
    }

    fn chosen(sessions: &[SessionRecord], target: &str) -> Result<String, (StatusCode, String)> {
        choose(sessions, target)
            .map(|s| s.name.to_string())
            .map_err(message)
    }

    #[test]
    fn the_user_name_chooses_the_session() {
        use SessionState::*;
        assert_eq!(
            chosen(&[], "alice"),
            Err((
                StatusCode::NOT_FOUND,
                "you have no session: start one with `devctl session new`".to_owned()
            ))
        );
        let one = [session("train1", Waiting)];
        assert_eq!(chosen(&one, "train1"), Ok("train1".to_owned()));
        assert_eq!(chosen(&one, "alice"), Ok("train1".to_owned()));
        assert_eq!(chosen(&one, "Not A Name!"), Ok("train1".to_owned()));
        let two = [session("train1", Waiting), session("exp2", Pending)];
        assert_eq!(chosen(&two, "exp2"), Ok("exp2".to_owned()));
        assert_eq!(
            chosen(&two, "alice"),
            Err((
                StatusCode::NOT_FOUND,
                "you have several sessions (train1 WAITING, exp2 PENDING): connect with \
                 ssh <name>@<this gateway>"
                    .to_owned()
            ))
        );
        // A FAILED session does not count when another is live or held...
        let with_failed = [session("old", Failed), session("new", Held)];
        assert_eq!(chosen(&with_failed, "alice"), Ok("new".to_owned()));
        assert_eq!(chosen(&with_failed, "old"), Ok("old".to_owned()));
        // ...but a lone one is chosen, so that the answer says it failed.
        assert_eq!(chosen(&[session("old", Failed)], "x"), Ok("old".to_owned()));
        let failed = [session("a", Failed), session("b", Failed)];
        assert!(chosen(&failed, "x")
            .unwrap_err()
            .1
            .contains("a FAILED, b FAILED"));
    }

    #[test]
    fn a_session_that_does_not_run_says_why_and_what_to_do() {
        use SessionState::*;
        let outcome = |state: SessionState, position: Option<u32>, url: Option<&str>| {
            reachable(&session("train1", state), position, url.map(str::to_owned))
                .map(|route| route.agent_url)
                .map_err(message)
        };
        let url = Some("wss://node1:8444");
        for state in [Waiting, Connected, Idle] {
            assert_eq!(outcome(state, None, url), Ok("wss://node1:8444".to_owned()));
        }
        let conflict = |text: &str| Err((StatusCode::CONFLICT, text.to_owned()));
        assert_eq!(
            outcome(Pending, Some(3), None),
            conflict(
                "session train1 is PENDING, number 3 in the queue: it starts once the \
                 scheduler gives it a GPU (devctl session show train1)"
            )
        );
        assert_eq!(
            outcome(Starting, None, None),
            conflict("session train1 is starting: try again in a few seconds")
        );
        assert_eq!(
            outcome(Held, None, None),
            conflict("session train1 is HELD (because): run `devctl session release train1`")
        );
        assert_eq!(
            outcome(Failed, None, None),
            conflict(
                "session train1 FAILED (because): remove it with `devctl session rm train1` and \
                 start a new one"
            )
        );
        let mut lost = session("train1", Failed);
        lost.reason = "node lost: ...; `devctl session rm train1` and start a new session".into();
        assert_eq!(
            reachable(&lost, None, None).map(|r| r.agent_url).map_err(message),
            conflict(
                "session train1 FAILED: node lost: ...; `devctl session rm train1` and start a new \
                 session"
            )
        );
        let (status, text) = outcome(Waiting, None, None).unwrap_err();
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            text.contains("node node1, whose agent has no [streams]"),
            "{text}"
        );
        let route = reachable(&session("train1", Idle), None, url.map(str::to_owned)).unwrap();
        assert_eq!(route.container, route.session_id.container_name());
        assert_eq!(route.node.as_str(), "node1");
        assert_eq!(
            outcome(Ended, None, None).unwrap_err().0,
            StatusCode::NOT_FOUND
        );
        // An ApiError still renders as an error body.
        let response = ApiError::conflict("x").into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
    }
}
