//! Who may open a stream, and to where: the WebSocket upgrade must come to [`STREAM_PATH`] with
//! the gateway's bearer token, and the [`StreamOpen`] must name a running dev container of this
//! node whose owner is the user the gateway authenticated.

use ongrid_core::stream::{StreamOpen, STREAM_PATH};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request};
use tokio_tungstenite::tungstenite::http::{header, StatusCode};

use crate::config::Token;
use crate::runtime::SessionContainer;

/// Checks the upgrade request; the `Err` is the HTTP answer (404 or 401, with a reason).
#[allow(clippy::result_large_err)] // tungstenite's callback signature
pub fn check_request(request: &Request, token: &Token) -> Result<(), ErrorResponse> {
    if request.uri().path() != STREAM_PATH {
        return Err(refusal(
            StatusCode::NOT_FOUND,
            format!("no such endpoint: streams are at {STREAM_PATH}"),
        ));
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(bearer_token);
    match presented {
        Some(presented) if tokens_match(presented.as_bytes(), token.expose().as_bytes()) => Ok(()),
        Some(_) => Err(refusal(
            StatusCode::UNAUTHORIZED,
            "wrong gateway token: the gateway's token_file and this agent's [streams] \
             gateway_token_file must hold the same token"
                .to_owned(),
        )),
        None => Err(refusal(
            StatusCode::UNAUTHORIZED,
            "missing gateway token: send Authorization: Bearer <gateway token>".to_owned(),
        )),
    }
}

/// The token of an `Authorization: Bearer <token>` value (the scheme is case-insensitive).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Compares two secrets in time that depends only on their lengths.
pub fn tokens_match(presented: &[u8], expected: &[u8]) -> bool {
    if presented.len() != expected.len() {
        return false;
    }
    let difference = presented
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(difference) == 0
}

fn refusal(status: StatusCode, message: String) -> ErrorResponse {
    let mut response = ErrorResponse::new(Some(message));
    *response.status_mut() = status;
    response
}

/// Why a stream was refused; the message is for the SSH user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("session {0} is not on this node (it may have ended or moved): connect again")]
    NotHere(String),
    #[error("session {0} belongs to another user")]
    NotOwner(String),
    #[error(
        "session {0} is not running (its container is stopped): see `devctl session show {0}`"
    )]
    NotRunning(String),
}

/// The container a stream may go to: this node's container of the session (`found`, as the
/// runtime looked it up), owned by the stream's user and running.
pub fn check_open(
    found: Option<SessionContainer>,
    open: &StreamOpen,
) -> Result<SessionContainer, Refusal> {
    let container = found.ok_or_else(|| Refusal::NotHere(open.session_id.to_string()))?;
    if container.owner != open.owner.as_str() {
        return Err(Refusal::NotOwner(container.session_name));
    }
    if !container.running {
        return Err(Refusal::NotRunning(container.session_name));
    }
    Ok(container)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::stream::StreamKind;
    use ongrid_core::{Dn, SessionId};
    use tokio_tungstenite::tungstenite::http;

    fn request(path: &str, authorization: Option<&str>) -> Request {
        let mut builder = http::Request::builder().uri(format!("wss://node1:8444{path}"));
        if let Some(value) = authorization {
            builder = builder.header(header::AUTHORIZATION, value);
        }
        builder.body(()).unwrap()
    }

    #[test]
    fn the_right_token_on_the_right_path_passes() {
        let token = Token::new("gw-secret-123");
        assert!(check_request(
            &request("/v1/streams", Some("Bearer gw-secret-123")),
            &token
        )
        .is_ok());
        assert!(check_request(
            &request("/v1/streams", Some("bearer  gw-secret-123 ")),
            &token
        )
        .is_ok());
    }

    #[test]
    fn wrong_missing_or_misplaced_tokens_are_refused() {
        let token = Token::new("gw-secret-123");
        let status = |path, authorization| {
            check_request(&request(path, authorization), &token)
                .unwrap_err()
                .status()
        };
        assert_eq!(status("/v1/streams", Some("Bearer gw-secret-124")), 401);
        assert_eq!(status("/v1/streams", Some("Bearer gw-secret-12")), 401);
        assert_eq!(status("/v1/streams", Some("Basic gw-secret-123")), 401);
        assert_eq!(status("/v1/streams", Some("Bearer ")), 401);
        assert_eq!(status("/v1/streams", None), 401);
        assert_eq!(status("/v1/other", Some("Bearer gw-secret-123")), 404);
        let answer =
            check_request(&request("/v1/streams", Some("Bearer nope")), &token).unwrap_err();
        let body = answer.body().clone().unwrap();
        assert!(body.contains("gateway_token_file"), "{body}");
        assert!(!body.contains("gw-secret"), "{body}");
    }

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(tokens_match(b"abc", b"abc"));
        assert!(!tokens_match(b"abc", b"abd"));
        assert!(!tokens_match(b"abc", b"abcd"));
        assert!(!tokens_match(b"", b"a"));
    }

    fn container(session_id: SessionId) -> SessionContainer {
        SessionContainer {
            id: "c1".into(),
            session_id,
            session_name: "train1".into(),
            owner: "/DC=org/DC=example/CN=Alice Smith".into(),
            login: "alice-smith".into(),
            user: "20001:20001".into(),
            running: true,
            pid: Some(4242),
        }
    }

    fn open(session_id: SessionId, owner: &str) -> StreamOpen {
        StreamOpen {
            session_id,
            owner: Dn::parse(owner).unwrap(),
            kind: StreamKind::Shell { pty: None },
            env: vec![],
        }
    }

    #[test]
    fn only_the_owner_reaches_a_running_container_of_this_node() {
        let id = SessionId::new_random();
        let alice = "/DC=org/DC=example/CN=Alice Smith";
        assert_eq!(
            check_open(Some(container(id)), &open(id, alice)),
            Ok(container(id))
        );
        assert_eq!(
            check_open(
                Some(container(id)),
                &open(id, "/DC=org/DC=example/CN=Mallory")
            ),
            Err(Refusal::NotOwner("train1".into()))
        );
        let stopped = SessionContainer {
            running: false,
            ..container(id)
        };
        let refusal = check_open(Some(stopped), &open(id, alice)).unwrap_err();
        assert_eq!(refusal, Refusal::NotRunning("train1".into()));
        assert!(refusal.to_string().contains("devctl session show train1"));
        assert_eq!(
            check_open(None, &open(id, alice)),
            Err(Refusal::NotHere(id.to_string()))
        );
    }
}
