//! The plumbing the ongrid binaries share, so each `main.rs` is a few lines and each config
//! module holds only its own keys: start-up and shutdown ([`process`]), secrets read from files
//! ([`Token`]), TOML config files ([`config_file`]), the metrics and health listener ([`metrics`]), PEM files and CA directories ([`pem`], the
//! latter read with `ongrid_x509`'s one reader) and the HTTPS client of the manager's
//! bearer-token routes ([`manager_http`], with the one check that `manager_url` is https), and
//! the streams to node agents: their client ([`agent_stream`], used by the gateway for SSH
//! channels and by the manager for web apps), its TLS roots ([`ca_roots`]) and the messages
//! after the WebSocket upgrade ([`websocket`]).
//!
//! No business logic lives here: nothing in this crate knows about sessions, nodes or SSH.

pub mod agent_stream;
pub mod ca_roots;
pub mod config_file;
pub mod config_reference;
pub mod manager_http;
pub mod metrics;
pub mod pem;
pub mod process;
mod secret;
pub mod websocket;

pub use process::{announce, bind_and_announce, init_tracing, Binary};
pub use secret::{Token, TokenError};
