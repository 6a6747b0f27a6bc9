//! Remote attachments (`files.fetch_remote = true`): an `http(s)` URL that chatd fetches
//! itself. Its host is resolved first and every address checked: loopback, private,
//! link-local, shared, unspecified and multicast addresses are refused, also where IPv6
//! carries them (IPv4-mapped, NAT64, 6to4) (an attachment must
//! not reach into chatd's own network), and the connection goes to the address that was
//! checked, so a second lookup cannot answer otherwise. Redirects are not followed; the
//! whole fetch has `files.fetch_timeout_secs`, and `files.max_bytes` holds as the bytes come.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use crate::config::FileSettings;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("Remote URLs are not fetched here (files.fetch_remote is off): upload the file or send a data: URL")]
    Off,
    #[error("The attachment URL is not an http(s) URL")]
    BadUrl,
    #[error(
        "The attachment URL's host resolves to a private, loopback or link-local address, which chatd does not fetch"
    )]
    Private,
    /// Why, in words safe to show the client (a transport error's own text is logged, not
    /// shown: it can name chatd's network).
    #[error("The attachment URL could not be fetched: {0}")]
    Failed(String),
    #[error("The remote file is too large")]
    TooLarge,
}

/// Whether chatd may connect to `ip` for a remote attachment.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                // Shared address space (carrier-grade NAT), and "this network".
                || (a == 100 && (64..128).contains(&b))
                || a == 0)
        }
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            let carried = |high: u16, low: u16| {
                std::net::Ipv4Addr::new((high >> 8) as u8, high as u8, (low >> 8) as u8, low as u8)
            };
            // IPv4 carried in IPv6 is judged as that IPv4 address: IPv4-mapped (::ffff:0:0/96),
            // IPv4-compatible (::/96, deprecated, yet a host may still route it to IPv4),
            // NAT64 (64:ff9b::/96) and 6to4 (2002::/16).
            if segments[..5] == [0; 5] && (segments[5] == 0 || segments[5] == 0xffff) {
                return is_public(IpAddr::V4(carried(segments[6], segments[7])));
            }
            if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return is_public(IpAddr::V4(carried(segments[6], segments[7])));
            }
            if segments[0] == 0x2002 {
                return is_public(IpAddr::V4(carried(segments[1], segments[2])));
            }
            // Otherwise only global unicast (2000::/3) is public: a list of what to refuse
            // misses the next form; one of what to take does not. Within it, Teredo
            // (2001::/32, an obfuscated IPv4 address) and documentation (2001:db8::/32).
            (segments[0] & 0xe000) == 0x2000 && segments[..2] != [0x2001, 0] && segments[..2] != [0x2001, 0xdb8]
        }
    }
}

/// The file at `url`: a name for it (the URL path's last segment) and its bytes as they come.
pub async fn fetch(
    url: &str,
    settings: &FileSettings,
) -> Result<(String, impl Stream<Item = Result<Bytes, reqwest::Error>> + use<>), RemoteError> {
    if !settings.fetch_remote {
        return Err(RemoteError::Off);
    }
    let parsed = url::Url::parse(url).map_err(|_| RemoteError::BadUrl)?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(RemoteError::BadUrl);
    }
    let host = parsed.host_str().ok_or(RemoteError::BadUrl)?.to_owned();
    let port = parsed.port_or_known_default().ok_or(RemoteError::BadUrl)?;
    let timeout = Duration::from_secs_f64(settings.fetch_timeout_secs.max(0.1));
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addresses: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::time::timeout(timeout, tokio::net::lookup_host((host.as_str(), port)))
            .await
            .map_err(|_| RemoteError::Failed("its host did not resolve in time".into()))?
            .map_err(|_| RemoteError::Failed("its host did not resolve".into()))?
            .collect(),
    };
    if addresses.is_empty() || addresses.iter().any(|a| !is_public(a.ip())) {
        return Err(RemoteError::Private);
    }
    // No proxy: a proxy would resolve the host again, past the check.
    let client = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .resolve_to_addrs(&host, &addresses)
        .build()
        .map_err(|e| {
            tracing::error!(error = %e, "cannot build the client for a remote attachment");
            RemoteError::Failed("chatd could not make the request".into())
        })?;
    let response = client.get(parsed.clone()).send().await.map_err(|e| {
        tracing::info!(error = %e, %host, "a remote attachment could not be fetched");
        RemoteError::Failed(match e.is_timeout() {
            true => "it did not answer within files.fetch_timeout_secs".into(),
            false => "the connection to its host failed".into(),
        })
    })?;
    if !response.status().is_success() {
        return Err(RemoteError::Failed(format!("it answered HTTP {}", response.status().as_u16())));
    }
    if response.content_length().is_some_and(|n| n > settings.max_bytes) {
        return Err(RemoteError::TooLarge);
    }
    let name = parsed
        .path_segments()
        .and_then(|mut s| s.next_back())
        .filter(|s| !s.is_empty())
        .and_then(percent_decoded)
        .unwrap_or_else(|| "download".to_owned());
    Ok((name, response.bytes_stream().boxed()))
}

fn percent_decoded(segment: &str) -> Option<String> {
    let decoded: String = url::form_urlencoded::parse(format!("n={segment}").as_bytes()).next()?.1.into_owned();
    crate::files::kind::check_name(&decoded).is_ok().then_some(decoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_fetched() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "64:ff9b::7f00:1",
            "2002:a00:1::1",
            // IPv4-compatible forms of loopback and private addresses.
            "::127.0.0.1",
            "::7f00:1",
            "::10.0.0.1",
            "::a9fe:a9fe",
            // Outside global unicast, or inside it but not public.
            "64:ff9b:1::7f00:1",
            "100::1",
            "2001::1",
            "2001:db8::1",
            "ff02::1",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in
            ["93.184.216.34", "2606:2800:220:1::248", "8.8.8.8", "64:ff9b::808:808", "2002:808:808::1", "::8.8.8.8"]
        {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }
}
