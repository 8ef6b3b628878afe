//! Fuzzes the path of an SSH user name from the gateway to the session it reaches: the
//! gateway's failure throttle keyed by it, the JSON it travels in (`KeyCheck`, `RouteRequest`),
//! `SessionName::parse`, and the manager's router (`app::gateway::choose` over an owner's
//! sessions, then `reachable`). The input is the user name as russh hands it over (UTF-8).
//!
//! Properties: nothing panics; a name `SessionName::parse` accepts is itself (same text, 1 to
//! 40 of `[a-z0-9-]`, no '-' at either end) and survives JSON; refusals name it escaped (no
//! control character reaches a message, so none reaches a log line or the user's terminal); the
//! router picks the session of that name when there is one and otherwise only the owner's one
//! live (or HELD) session or only session; failures of one name at one address never throttle
//! another name there, nor the same name elsewhere.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::OnceLock;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use libfuzzer_sys::fuzz_target;
use ongrid_core::api::{KeyCheck, RouteRequest};
use ongrid_core::gpu::GpuRequest;
use ongrid_core::names::{Dn, NodeName, SessionId, SessionName, UserName};
use ongrid_core::session::SessionState;
use ongrid_gateway::throttle::{Policies, Policy, Throttle, ThrottledBy};
use ongrid_manager::app::gateway::{choose, reachable};
use ongrid_manager::domain::sessions::SessionRecord;

fn owner() -> Dn {
    Dn::parse("/DC=org/DC=example/CN=Alice Smith").expect("fixture DN")
}

fn session(name: &str, state: SessionState) -> SessionRecord {
    let at = Utc
        .with_ymd_and_hms(2026, 5, 1, 9, 0, 0)
        .single()
        .expect("fixture time");
    SessionRecord {
        id: SessionId::new_random(),
        name: SessionName::parse(name).expect("fixture name"),
        owner: owner(),
        user_name: UserName::parse("alice").expect("fixture user"),
        uid: 20_000,
        state,
        reason: "fixture".to_owned(),
        request: GpuRequest::default(),
        image: "ongrid/dev:latest".to_owned(),
        node: state
            .holds_gpus()
            .then(|| NodeName::parse("node1").expect("fixture node")),
        gpus: Vec::new(),
        created_at: at,
        queued_at: at,
        preferred_node: None,
    }
}

/// Owners' session lists the router is tried against.
fn sites() -> &'static [Vec<SessionRecord>] {
    static SITES: OnceLock<Vec<Vec<SessionRecord>>> = OnceLock::new();
    SITES.get_or_init(|| {
        use SessionState::*;
        vec![
            vec![],
            vec![session("train1", Waiting)],
            vec![session("broken", Failed)],
            vec![session("dev", Held), session("old", Failed)],
            vec![
                session("train1", Connected),
                session("dev", Held),
                session("dev-2", Pending),
                session("eval", Starting),
                session("old", Failed),
            ],
            SessionState::ALL
                .iter()
                .enumerate()
                .filter(|(_, s)| **s != Ended)
                .map(|(i, s)| session(&format!("s{i}"), *s))
                .collect(),
        ]
    })
}

fn no_control(what: &str, message: &str) {
    assert!(
        !message.chars().any(char::is_control),
        "{what} carries a control character: {message:?}"
    );
}

fn check_name(login: &str) -> Option<SessionName> {
    match SessionName::parse(login) {
        Ok(name) => {
            assert_eq!(name.as_str(), login);
            assert_eq!(name.to_string(), login);
            assert!(
                (1..=SessionName::MAX_LEN).contains(&login.len()),
                "{login:?}"
            );
            assert!(
                login
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{login:?}"
            );
            assert!(
                !login.starts_with('-') && !login.ends_with('-'),
                "{login:?}"
            );
            let json = serde_json::to_string(&name).expect("serialise a name");
            let back: SessionName = serde_json::from_str(&json).expect("parse own JSON");
            assert_eq!(back, name);
            Some(name)
        }
        Err(error) => {
            no_control("a name refusal", &error.to_string());
            assert!(
                serde_json::from_value::<SessionName>(serde_json::Value::String(login.to_owned()))
                    .is_err(),
                "JSON accepts a name parse refuses: {login:?}"
            );
            None
        }
    }
}

fn check_wire(login: &str) {
    let route = RouteRequest {
        owner: owner(),
        target: login.to_owned(),
    };
    let json = serde_json::to_vec(&route).expect("serialise a route request");
    let back: RouteRequest = serde_json::from_slice(&json).expect("parse own JSON");
    assert_eq!(back, route);
    let check = KeyCheck {
        public_key: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFuzz".to_owned(),
        source: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)),
        login: login.to_owned(),
    };
    let json = serde_json::to_vec(&check).expect("serialise a key check");
    let back: KeyCheck = serde_json::from_slice(&json).expect("parse own JSON");
    assert_eq!(back, check);
}

fn check_router(login: &str, name: Option<&SessionName>) {
    for sessions in sites() {
        match choose(sessions, login) {
            Ok(chosen) => {
                assert!(sessions.iter().any(|s| s.id == chosen.id));
                let named = name.and_then(|n| sessions.iter().find(|s| &s.name == n));
                match named {
                    Some(named) => assert_eq!(chosen.id, named.id, "{login:?}"),
                    None => {
                        let candidates = sessions
                            .iter()
                            .filter(|s| s.state.is_live() || s.state == SessionState::Held)
                            .count();
                        assert!(
                            candidates == 1 || (candidates == 0 && sessions.len() == 1),
                            "{login:?} reached {} among {candidates} candidates",
                            chosen.name
                        );
                    }
                }
                let agent = Some("wss://node1.example.org:8444".to_owned());
                match reachable(chosen, Some(3), agent) {
                    Ok(route) => {
                        assert_eq!(route.session_name, chosen.name);
                        assert_eq!(route.session_id, chosen.id);
                    }
                    Err(error) => no_control("a route refusal", error.message()),
                }
            }
            Err(error) => {
                assert!(
                    name.is_none_or(|n| sessions.iter().all(|s| &s.name != n)),
                    "{login:?} refused though a session has that name"
                );
                no_control("a route refusal", error.message());
            }
        }
    }
}

fn throttle() -> Throttle {
    let long = Duration::from_secs(3600);
    Throttle::new(Policies {
        address: Policy {
            burst: 100,
            refill: long,
        },
        user_at_address: Policy {
            burst: 1,
            refill: long,
        },
    })
}

fn check_throttle(login: &str) {
    let here = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
    let elsewhere = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 9));
    let throttle = throttle();
    assert!(throttle.check(here, login).is_ok());
    throttle.failure(here, login);
    let refused = throttle
        .check(here, login)
        .expect_err("the one failure is spent");
    assert_eq!(refused.by, ThrottledBy::UserAtAddress);
    // Names are compared case-insensitively: another first character is another name.
    let first = login.chars().next().map(|c| c.to_lowercase().to_string());
    let prefix = if first.as_deref() == Some("x") {
        'y'
    } else {
        'x'
    };
    let other = format!("{prefix}{login}");
    assert!(
        throttle.check(here, &other).is_ok(),
        "{other:?} throttled by {login:?}"
    );
    assert!(throttle.check(elsewhere, login).is_ok());
    throttle.refund(here, login);
    assert!(throttle.check(here, login).is_ok(), "refunded");
}

fuzz_target!(|data: &[u8]| {
    // russh hands the handler a &str: user names that are not UTF-8 never get this far.
    let Ok(login) = std::str::from_utf8(data) else {
        return;
    };
    let name = check_name(login);
    check_wire(login);
    check_router(login, name.as_ref());
    check_throttle(login);
});
