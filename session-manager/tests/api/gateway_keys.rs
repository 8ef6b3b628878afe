//! The gateway's re-check of the keys of its open connections (`POST /v1/gateway/keys/check`):
//! valid keys are left out of the answer; removed, re-registered and expired ones come back
//! with the message the gateway shows before closing their connections.

use ongrid_core::api::{HeldKey, HeldKeys, Revocation, RevokedKeys};

use super::*;

fn held(fingerprint: &str, owner: &str) -> HeldKey {
    HeldKey {
        fingerprint: fingerprint.to_owned(),
        owner: Dn::parse(owner).unwrap(),
    }
}

async fn check(m: &Running, keys: Vec<HeldKey>) -> RevokedKeys {
    m.gateway
        .ok(
            StatusCode::OK,
            m.gateway.post("/v1/gateway/keys/check", &HeldKeys { keys }),
        )
        .await
}

#[tokio::test]
async fn the_gateway_learns_which_keys_of_open_connections_were_removed_or_expired() {
    let site = Site::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let m = site
        .start_with(site.config.clone(), Some(clock.clone()))
        .await;
    let _: KeyView = m
        .alice_short
        .ok(
            StatusCode::CREATED,
            m.alice_short.post("/v1/keys", &add_key(KEY_A)),
        )
        .await;
    let _: KeyView = m
        .bob
        .ok(StatusCode::CREATED, m.bob.post("/v1/keys", &add_key(KEY_B)))
        .await;

    // Both valid: nothing to close; users and other callers cannot ask.
    let both = vec![held(KEY_A_FP, ALICE), held(KEY_B_FP, BOB)];
    assert_eq!(check(&m, both.clone()).await.revoked, Vec::new());
    let (status, _) = m
        .alice
        .send(
            m.alice
                .post("/v1/gateway/keys/check", &HeldKeys { keys: both.clone() }),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // A key held under another owner than its own counts as removed for that owner.
    let answer = check(&m, vec![held(KEY_B_FP, ALICE)]).await;
    assert_eq!(answer.revoked.len(), 1);
    assert_eq!(answer.revoked[0].why, Revocation::Removed);

    // Bob removes his key: only his comes back, once however often it is listed.
    let removed_at = clock.now();
    let remove = format!("/v1/keys?fingerprint={}", urlencode(KEY_B_FP));
    let _: KeyView = m.bob.ok(StatusCode::OK, m.bob.delete(&remove)).await;
    let mut keys = both.clone();
    keys.push(held(KEY_B_FP, BOB));
    let answer = check(&m, keys).await;
    assert_eq!(answer.revoked.len(), 1, "{answer:?}");
    let revoked = &answer.revoked[0];
    assert_eq!(revoked.key, held(KEY_B_FP, BOB));
    assert_eq!(revoked.why, Revocation::Removed);
    assert_eq!(revoked.at, removed_at);
    assert!(
        revoked
            .message
            .starts_with(&format!("your SSH key {KEY_B_FP} was removed at ")),
        "{}",
        revoked.message
    );
    assert!(
        revoked
            .message
            .ends_with("run `devctl key add` to register a key again"),
        "{}",
        revoked.message
    );

    // Alice's proxy expires: her key comes back as expired, at its expiry.
    clock.advance(site.short_expiry - clock.now() + TimeDelta::seconds(1));
    let answer = check(&m, vec![held(KEY_A_FP, ALICE)]).await;
    assert_eq!(answer.revoked.len(), 1, "{answer:?}");
    let revoked = &answer.revoked[0];
    assert_eq!(revoked.why, Revocation::Expired);
    assert_eq!(revoked.at, site.short_expiry);
    assert!(
        revoked.message.contains("expired at")
            && revoked
                .message
                .ends_with("renew your proxy (voms-proxy-init) and run `devctl key add` again"),
        "{}",
        revoked.message
    );

    // Bounded: a gateway cannot make one check do unbounded work.
    let many = vec![held(KEY_A_FP, ALICE); 10_001];
    let (status, body) = m
        .gateway
        .send(
            m.gateway
                .post("/v1/gateway/keys/check", &HeldKeys { keys: many }),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    m.stop().await;
}
