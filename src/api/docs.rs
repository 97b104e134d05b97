//! `/docs`: Swagger UI over the served `/openapi.json`, its files embedded in the binary at
//! build time (utoipa-swagger-ui's `vendored` feature: nothing is downloaded at build or run
//! time). Public, like the console page: it holds no data, and "Authorize" takes a key for
//! the requests it sends.

use axum::Router;
use utoipa_swagger_ui::{Config, SwaggerUi};

use super::AppState;

/// The docs page's routes: `/docs` (redirects to `/docs/`) and its assets under `/docs/`.
pub fn router() -> Router<AppState> {
    let config = Config::from("/openapi.json")
        .try_it_out_enabled(true)
        .persist_authorization(true)
        .display_request_duration(true)
        // Swagger UI would otherwise ask validator.swagger.io about the document whenever the
        // page is not served from localhost: nothing is fetched from the internet.
        .validator_url("none");
    SwaggerUi::new("/docs").config(config).into()
}
