//! Who a request acts for, per `auth.mode`: `none` (the `X-Client-Id` header, else `local`),
//! `token` (a configured bearer token) or `jwt` (a bearer JWT: HS256 or RS256, `sub` is the
//! user, `exp` required, `nbf` checked, `aud`/`iss` required and checked when configured); and the per-user request
//! rate limit.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use crate::config::{AuthMode, Settings};
use crate::http::error::AppError;

/// The user of auth mode `none` when no `X-Client-Id` is sent.
const LOCAL_USER: &str = "local";
const MAX_USER_ID_CHARS: usize = 200;

pub struct Authenticator {
    mode: AuthMode,
    tokens: std::collections::BTreeMap<String, String>,
    jwt: Option<(DecodingKey, Validation)>,
    limiter: Option<DefaultKeyedRateLimiter<String>>,
    failures: Option<FailureLimit>,
}

/// Failed authentications per client address. An address that used up its budget is locked
/// out until the budget has room again: every request it sends meanwhile, right or wrong,
/// gets 429, so that guessing cannot tell a hit by its answer.
struct FailureLimit {
    limiter: DefaultKeyedRateLimiter<IpAddr>,
    locked: Mutex<HashMap<IpAddr, Instant>>,
}

impl FailureLimit {
    fn refuse_if_locked(&self, peer: IpAddr) -> Result<(), AppError> {
        let locked = self.locked.lock().expect("auth lock");
        match locked.get(&peer) {
            Some(until) if *until > Instant::now() => Err(too_many_failures(*until - Instant::now())),
            _ => Ok(()),
        }
    }

    /// Counts a failure; the error to answer with (429 once the budget is gone).
    fn failed(&self, peer: IpAddr) -> AppError {
        match self.limiter.check_key(&peer) {
            Ok(()) => unauthorized(),
            Err(not_until) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now()).max(Duration::from_secs(1));
                tracing::warn!(%peer, "too many failed authentications; locked out for a while");
                self.locked.lock().expect("auth lock").insert(peer, Instant::now() + wait);
                too_many_failures(wait)
            }
        }
    }
}

fn too_many_failures(wait: Duration) -> AppError {
    AppError::RateLimited { message: "Too many failed authentications; try again later".into(), retry_after: wait }
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
}

impl Authenticator {
    pub fn new(settings: &Settings) -> Result<Self, String> {
        let jwt = match settings.auth.mode {
            AuthMode::Jwt => {
                let config = &settings.auth.jwt;
                let (key, algorithm) = match (&config.public_key_pem, &config.secret) {
                    (Some(pem), _) => (
                        DecodingKey::from_rsa_pem(pem.as_bytes())
                            .map_err(|e| format!("auth.jwt.public_key_file: {e}"))?,
                        Algorithm::RS256,
                    ),
                    (None, Some(secret)) => (DecodingKey::from_secret(secret.expose().as_bytes()), Algorithm::HS256),
                    (None, None) => return Err("auth.jwt has no key".to_owned()),
                };
                let mut validation = Validation::new(algorithm);
                // A configured audience or issuer must be in the token: jsonwebtoken checks
                // these claims only when they are there, unless they are required.
                let mut required = vec!["exp", "sub"];
                match &config.audience {
                    Some(audience) => {
                        validation.set_audience(&[audience]);
                        required.push("aud");
                    }
                    None => validation.validate_aud = false,
                }
                if let Some(issuer) = &config.issuer {
                    validation.set_issuer(&[issuer]);
                    required.push("iss");
                }
                validation.set_required_spec_claims(&required);
                validation.validate_nbf = true;
                validation.leeway = config.leeway_secs;
                Some((key, validation))
            }
            _ => None,
        };
        let limiter = NonZeroU32::new(settings.limits.requests_per_minute)
            .map(|per_minute| RateLimiter::keyed(Quota::per_minute(per_minute)));
        let failures = NonZeroU32::new(settings.limits.failed_auth_per_minute)
            .filter(|_| settings.auth.mode != AuthMode::None)
            .map(|per_minute| FailureLimit {
                limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
                locked: Mutex::default(),
            });
        Ok(Self { mode: settings.auth.mode, tokens: settings.auth.tokens.clone(), jwt, limiter, failures })
    }

    /// The request's user, or 401 (400 for a malformed `X-Client-Id`; 429 for an address
    /// with too many failed attempts, `peer` where the server knows it).
    pub fn user(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<String, AppError> {
        let Some((failures, peer)) = self.failures.as_ref().zip(peer) else {
            return self.authenticate(headers);
        };
        failures.refuse_if_locked(peer)?;
        self.authenticate(headers).map_err(|e| match e {
            AppError::Unauthorized(_) => failures.failed(peer),
            other => other,
        })
    }

    fn authenticate(&self, headers: &HeaderMap) -> Result<String, AppError> {
        match self.mode {
            AuthMode::None => match headers.get("x-client-id").map(|v| v.to_str().map(str::trim)) {
                None | Some(Ok("")) => Ok(LOCAL_USER.to_owned()),
                Some(Ok(id)) if id.chars().count() <= MAX_USER_ID_CHARS => Ok(id.to_owned()),
                _ => Err(AppError::validation(
                    "X-Client-Id",
                    "X-Client-Id must be visible ASCII, at most 200 characters",
                )),
            },
            AuthMode::Token => {
                bearer(headers).and_then(|token| self.tokens.get(token).cloned()).ok_or_else(unauthorized)
            }
            AuthMode::Jwt => {
                let (key, validation) = self.jwt.as_ref().ok_or_else(unauthorized)?;
                let token = bearer(headers).ok_or_else(unauthorized)?;
                let claims = jsonwebtoken::decode::<Claims>(token, key, validation).map_err(|e| {
                    tracing::info!(error = %e, "JWT refused");
                    unauthorized()
                })?;
                let sub = claims.claims.sub;
                // The user id is stored with every row: no control characters (Postgres
                // refuses NUL in text), nothing longer than an X-Client-Id may be.
                if sub.trim().is_empty() || sub.chars().count() > MAX_USER_ID_CHARS || sub.chars().any(char::is_control)
                {
                    tracing::info!("JWT refused: its sub is not a usable user id");
                    return Err(unauthorized());
                }
                Ok(sub)
            }
        }
    }

    /// Counts a request against the user's rate; 429 with the wait when over it.
    pub fn admit(&self, user: &str) -> Result<(), AppError> {
        let Some(limiter) = &self.limiter else { return Ok(()) };
        limiter.check_key(&user.to_owned()).map_err(|not_until| {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            AppError::RateLimited {
                message: "Rate limited, try again".into(),
                retry_after: wait.max(Duration::from_secs(1)),
            }
        })
    }

    /// Forgets the rate state of users idle for a while (call now and then).
    pub fn forget_idle(&self) {
        if let Some(limiter) = &self.limiter {
            limiter.retain_recent();
        }
        if let Some(failures) = &self.failures {
            failures.limiter.retain_recent();
            failures.locked.lock().expect("auth lock").retain(|_, until| *until > Instant::now());
        }
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ").map(str::trim)
}

fn unauthorized() -> AppError {
    AppError::Unauthorized("Missing or invalid credentials".into())
}
