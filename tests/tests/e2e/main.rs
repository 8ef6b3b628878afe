//! End-to-end tests: the real manager, agent and devctl binaries against the real Docker daemon.
//! One test binary for the crate; each module is one area of behaviour.

mod browser;
mod dashboard;
mod freeze;
mod identity;
mod jobs;
mod lifecycle;
mod metrics;
mod mig;
mod nodes;
mod policy;
mod replicas;
mod sessions;
mod several_nodes;
mod ssh;
mod tokens;
mod web_apps;
