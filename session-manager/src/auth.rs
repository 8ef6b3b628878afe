//! Who is calling: users by TLS client certificate, agents by per-node bearer token, the SSH
//! gateway by its own bearer token.
//!
//! The accept loop ([`crate::server`]) puts a [`Peer`] into every request's extensions; the
//! extractors here turn it into a [`CurrentUser`] (user routes) or read the `Authorization`
//! header into an [`AgentNode`] (agent routes) or a [`GatewayCaller`] (gateway routes), or
//! refuse with 401. Tokens are kept as SHA-256 digests and compared in constant time.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use chrono::{DateTime, Utc};
use ongrid_core::NodeName;
use sha2::{Digest, Sha256};

use crate::api::{ApiError, AppState};
use crate::store::UserRecord;
use crate::tls::Identity;

/// The other end of the connection a request came on.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// Present when the client authenticated with a certificate.
    pub identity: Option<Identity>,
}

/// A user authenticated by certificate, with their stored login and UID.
#[derive(Debug, Clone)]
pub struct CurrentUser {
    pub user: UserRecord,
    /// Listed in the config's `admins`.
    pub admin: bool,
    /// Until when the credential presented on this connection is valid.
    pub not_after: DateTime<Utc>,
}

impl FromRequestParts<AppState> for CurrentUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let identity = parts
            .extensions
            .get::<Peer>()
            .and_then(|peer| peer.identity.as_ref())
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    "this route needs your grid certificate: connect with a TLS client \
                     certificate (or proxy) issued by a CA the site trusts",
                )
            })?;
        let user = state
            .store
            .user(&identity.dn, state.config.first_uid)
            .await?;
        let admin = state.config.admins.contains(&user.dn);
        Ok(Self {
            user,
            admin,
            not_after: identity.not_after,
        })
    }
}

/// The node whose agent is calling, named by its bearer token.
#[derive(Debug, Clone)]
pub struct AgentNode(pub NodeName);

impl FromRequestParts<AppState> for AgentNode {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(
            parts,
            "agent routes need `Authorization: Bearer <node token>`: set the agent's token_file",
            "node token",
        )?;
        let node = state.tokens.node_for(token).ok_or_else(|| {
            ApiError::unauthenticated(
                "unknown node token: it must match a line of the manager's agent_tokens_file",
            )
        })?;
        Ok(Self(node.clone()))
    }
}

/// The SSH gateway, authenticated by the token of the manager's `gateway_token_file`.
#[derive(Debug, Clone, Copy)]
pub struct GatewayCaller;

impl FromRequestParts<AppState> for GatewayCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let expected = state.gateway_token.as_ref().ok_or_else(|| {
            ApiError::unauthenticated(
                "gateway routes are not enabled on this manager: set gateway_token_file in its \
                 config to the gateway's token",
            )
        })?;
        let token = bearer(
            parts,
            "gateway routes need `Authorization: Bearer <gateway token>`: set the gateway's \
             token_file",
            "gateway token",
        )?;
        if !expected.matches(token) {
            return Err(ApiError::unauthenticated(
                "wrong gateway token: it must equal the one in the manager's gateway_token_file",
            ));
        }
        Ok(Self)
    }
}

/// The token of `Authorization: Bearer <token>`, or 401 with `missing` (no header) or a message
/// naming `what` (another scheme).
fn bearer<'a>(parts: &'a Parts, missing: &str, what: &str) -> Result<&'a str, ApiError> {
    let header = parts
        .headers
        .get(AUTHORIZATION)
        .ok_or_else(|| ApiError::unauthenticated(missing))?
        .to_str()
        .unwrap_or_default();
    header
        .strip_prefix("Bearer ")
        .map(str::trim)
        .ok_or_else(|| {
            ApiError::unauthenticated(format!(
                "the Authorization header must be `Bearer <{what}>`"
            ))
        })
}

/// Why the gateway token file was refused.
#[derive(Debug, thiserror::Error)]
pub enum GatewayTokenError {
    #[error("reading gateway_token_file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("gateway_token_file {}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// The gateway's token, kept only as a SHA-256 digest; `Debug` never shows it.
pub struct GatewayToken {
    digest: [u8; 32],
}

impl fmt::Debug for GatewayToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GatewayToken(<secret>)")
    }
}

impl GatewayToken {
    /// Reads the file: one line, the token (surrounding blank space ignored).
    pub fn load(path: &Path) -> Result<Self, GatewayTokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| GatewayTokenError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|message| GatewayTokenError::Invalid {
            path: path.to_owned(),
            message,
        })
    }

    /// Checks the file's text; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let token = text.trim();
        if token.is_empty() {
            return Err(
                "is empty: put the gateway's token in it (`openssl rand -hex 32`)".to_owned(),
            );
        }
        if token.contains(char::is_whitespace) {
            return Err("must hold one token on one line, without spaces".to_owned());
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "the token is shorter than {MIN_TOKEN_LEN} characters: make one with \
                 `openssl rand -hex 32`"
            ));
        }
        Ok(Self {
            digest: digest(token),
        })
    }

    /// Whether `token` is the gateway's (constant time).
    pub fn matches(&self, token: &str) -> bool {
        constant_time_eq(&digest(token), &self.digest)
    }

    /// The node whose agent token is the same as the gateway's, if any: each must have its own.
    pub fn shared_with<'a>(&self, agents: &'a AgentTokens) -> Option<&'a NodeName> {
        let mut found = None;
        for (node, expected) in &agents.entries {
            if constant_time_eq(&self.digest, expected) {
                found = Some(node);
            }
        }
        found
    }
}

/// Why the agent tokens file was refused.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("reading agent_tokens_file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("agent_tokens_file {} line {line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// The shortest token accepted: shorter ones can be guessed.
pub const MIN_TOKEN_LEN: usize = 16;

/// The per-node tokens, kept only as SHA-256 digests; `Debug` shows node names only.
pub struct AgentTokens {
    entries: Vec<(NodeName, [u8; 32])>,
}

impl fmt::Debug for AgentTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentTokens")
            .field(
                "nodes",
                &self.entries.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl AgentTokens {
    /// Reads lines `<node-name> <token>`; blank lines and `#` comments are skipped.
    pub fn load(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|(line, message)| TokenFileError::Line {
            path: path.to_owned(),
            line,
            message,
        })
    }

    /// Parses the file's text; an error carries the 1-based line number.
    pub fn parse(text: &str) -> Result<Self, (usize, String)> {
        let mut entries = Vec::new();
        let mut nodes = BTreeSet::new();
        let mut digests = BTreeSet::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [node, token] = fields[..] else {
                return Err((
                    number,
                    "must be `<node-name> <token>` (two fields)".to_owned(),
                ));
            };
            let node = NodeName::parse(node).map_err(|e| (number, e.to_string()))?;
            if token.len() < MIN_TOKEN_LEN {
                return Err((
                    number,
                    format!(
                        "the token of {node} is shorter than {MIN_TOKEN_LEN} characters: \
                         make one with `openssl rand -hex 32`"
                    ),
                ));
            }
            if !nodes.insert(node.clone()) {
                return Err((number, format!("node {node} is listed twice")));
            }
            let digest = digest(token);
            if !digests.insert(digest) {
                return Err((
                    number,
                    format!("the token of {node} is also another node's: give each its own"),
                ));
            }
            entries.push((node, digest));
        }
        Ok(Self { entries })
    }

    /// The node this token belongs to. Compares digests in constant time and always looks at
    /// every entry, so timing tells nothing about how close a guess was.
    pub fn node_for(&self, token: &str) -> Option<&NodeName> {
        let presented = digest(token);
        let mut found = None;
        for (node, expected) in &self.entries {
            if constant_time_eq(&presented, expected) {
                found = Some(node);
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# node tokens
node1 0123456789abcdef0123456789abcdef

  node2   fedcba9876543210fedcba9876543210  \n";

    #[test]
    fn tokens_name_their_node() {
        let tokens = AgentTokens::parse(FILE).unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(
            tokens
                .node_for("0123456789abcdef0123456789abcdef")
                .map(NodeName::as_str),
            Some("node1")
        );
        assert_eq!(
            tokens
                .node_for("fedcba9876543210fedcba9876543210")
                .map(NodeName::as_str),
            Some("node2")
        );
        assert_eq!(tokens.node_for("0123456789abcdef0123456789abcdee"), None);
        assert_eq!(tokens.node_for(""), None);
        let debug = format!("{tokens:?}");
        assert!(!debug.contains("0123456789abcdef"), "{debug}");
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        let err = |text: &str| AgentTokens::parse(text).unwrap_err();
        assert_eq!(err("node1\n").0, 1);
        assert_eq!(err("# c\nnode1 a b\n").0, 2);
        assert!(err("Node_1 0123456789abcdef0123\n").1.contains("node name"));
        assert!(err("node1 short\n").1.contains("openssl rand"));
        let twice = "node1 0123456789abcdef0123\nnode1 0123456789abcdef9999\n";
        assert_eq!(err(twice), (2, "node node1 is listed twice".to_owned()));
        let shared = "node1 0123456789abcdef0123\nnode2 0123456789abcdef0123\n";
        assert_eq!(err(shared).0, 2);
    }

    #[test]
    fn the_gateway_token_is_one_line_and_secret() {
        let token = GatewayToken::parse("  gw-0123456789abcdef0123\n").unwrap();
        assert!(token.matches("gw-0123456789abcdef0123"));
        assert!(!token.matches("gw-0123456789abcdef0124"));
        assert!(!token.matches(""));
        assert_eq!(format!("{token:?}"), "GatewayToken(<secret>)");
        assert!(GatewayToken::parse("\n").unwrap_err().contains("empty"));
        assert!(GatewayToken::parse("short")
            .unwrap_err()
            .contains("openssl rand"));
        assert!(
            GatewayToken::parse("0123456789abcdef0123\nsecond-line-0123456789")
                .unwrap_err()
                .contains("one line")
        );
        let agents = AgentTokens::parse(FILE).unwrap();
        let shared = GatewayToken::parse("fedcba9876543210fedcba9876543210").unwrap();
        assert_eq!(
            shared.shared_with(&agents).map(NodeName::as_str),
            Some("node2")
        );
        assert_eq!(token.shared_with(&agents), None);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gateway-token");
        std::fs::write(&path, "x\n").unwrap();
        let message = GatewayToken::load(&path).unwrap_err().to_string();
        assert!(message.starts_with("gateway_token_file "), "{message}");
        assert!(matches!(
            GatewayToken::load(&dir.path().join("missing")),
            Err(GatewayTokenError::Read { .. })
        ));
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent-tokens");
        std::fs::write(&path, "node1 x\n").unwrap();
        let message = AgentTokens::load(&path).unwrap_err().to_string();
        assert!(message.starts_with("agent_tokens_file "), "{message}");
        assert!(message.contains("line 1"), "{message}");
        let missing = AgentTokens::load(&dir.path().join("missing")).unwrap_err();
        assert!(matches!(missing, TokenFileError::Read { .. }));
    }
}
